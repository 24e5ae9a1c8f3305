"""The one exception tree of modelship.

Every error a user can meet is a :class:`ModelshipError`. Each carries structured fields,
a message that names the problem, and a ``hint`` that says what to do next. Vendor
exceptions (botocore, mlflow, tritonclient, prefect, slack_sdk) are translated at the
boundary with ``raise ... from exc`` and never leak into ``flows/``.

::

    ModelshipError                      exit 1 unless stated
    ├── UsageError                      exit 2  bad flags, bad policy file, bad settings
    │   ├── PolicyError                 exit 2
    │   └── CredentialsRejected         exit 2  a server refused the configured credentials
    ├── InfrastructureError             exit 1  something we talk to is not there / broke
    │   ├── Unreachable                         a server did not answer (names the endpoint)
    │   ├── StackError                          the embedded stack could not start / stop
    │   └── StorageError                        S3 refused or failed
    └── ReleaseError                    a release stopped on purpose
        ├── PreflightError              exit 1
        ├── ModelNotFound               exit 2
        ├── ExportError                 exit 3
        ├── ValidationFailed            exit 3
        ├── StagingError                exit 3
        ├── EvidenceMissing             exit 3  no passing canary on record for the digest
        ├── GateFailed                  exit 4
        ├── GatesInconclusive           exit 6
        ├── ApprovalDenied              exit 5
        ├── ApprovalUnavailable         exit 2  approval needed, no channel to ask it
        ├── BakeBreached                exit 4  the bake rolled the release back
        ├── SwapAborted                 exit 1
        ├── ReleaseLocked               exit 1
        ├── ReleaseIncomplete           exit 1  a way out could not be finished; recorded
        │                                       ``incomplete``, the next command finishes it
        └── ReleaseCancelled            exit 128 + signal (130 SIGINT, 143 SIGTERM): a stop
                                                request; the release ended undone
"""

from __future__ import annotations

from typing import Any


class ModelshipError(Exception):
    """Base of every modelship error.

    Args:
        message: What happened, naming the object and, where relevant, the measured value
            and the threshold.
        hint: What the user should do next.
        **details: Structured fields (JSON-serialisable) for ``--json`` output and logs.
    """

    exit_code: int = 1

    def __init__(self, message: str, *, hint: str | None = None, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.details = details

    def __str__(self) -> str:
        if not self.hint:
            return self.message
        hint = self.hint[0].upper() + self.hint[1:]
        return f"{self.message.rstrip('.')}. {hint.rstrip('.')}."

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready description, used by ``--json`` output."""
        return {
            "error": type(self).__name__,
            "message": self.message,
            "hint": self.hint,
            "exit_code": self.exit_code,
            **({"details": self.details} if self.details else {}),
        }


class UsageError(ModelshipError):
    """The user asked for something malformed: flags, settings, files."""

    exit_code = 2


class PolicyError(UsageError):
    """A release policy file is invalid (unknown key, wrong type, bad value)."""


class CredentialsRejected(UsageError):
    """A server answered, but refused the credentials modelship was configured with."""


class InfrastructureError(ModelshipError):
    """Something modelship talks to is missing, down or broken."""

    exit_code = 1


class Unreachable(InfrastructureError):
    """A server did not answer within its timeout."""


class StackError(InfrastructureError):
    """The embedded local stack could not be started, inspected or stopped."""


class StorageError(InfrastructureError):
    """The object store refused or failed a request."""


class ReleaseError(ModelshipError):
    """A release stopped on purpose; production keeps serving what it served."""


class PreflightError(ReleaseError):
    """One or more endpoints could not be reached before anything changed."""


class ModelNotFound(ReleaseError):
    """The model, version or alias does not exist in the registry."""

    exit_code = 2


class ExportError(ReleaseError):
    """The model could not be turned into a valid ONNX graph."""

    exit_code = 3


class ValidationFailed(ReleaseError):
    """The candidate broke the contract, the config lint, the data checks or the trial load."""

    exit_code = 3


class StagingError(ReleaseError):
    """The candidate could not be staged (e.g. an immutable version would change)."""

    exit_code = 3


class EvidenceMissing(ReleaseError):
    """A swap was asked for a candidate with no passing canary on record."""

    exit_code = 3


class GateFailed(ReleaseError):
    """At least one canary gate failed."""

    exit_code = 4


class GatesInconclusive(ReleaseError):
    """The gates could not decide (too few samples, no data)."""

    exit_code = 6


class ApprovalDenied(ReleaseError):
    """The approver rejected the release, or the approval expired."""

    exit_code = 5


class ApprovalUnavailable(ReleaseError):
    """The release needs an approval that no configured channel can give."""

    exit_code = 2


class BakeBreached(GateFailed):
    """The fleet breached the bake after the swap and was rolled back."""


class SwapAborted(ReleaseError):
    """The fleet swap was aborted; every replica was returned to the previous version."""


class ReleaseLocked(ReleaseError):
    """Another release or swap of the same model is already running."""


class ReleaseIncomplete(ReleaseError):
    """A release could not reach released or undone now (a dependency is down); its record
    says ``incomplete`` and what is missing, and the next command finishes it."""


class ReleaseCancelled(ReleaseError):
    """A SIGINT, SIGTERM or Prefect cancel stopped a release, which undid what it had
    changed (or finished it, past its point of no return) before it stopped.

    Args:
        signum: The signal; the exit code is ``128 + signum`` (130, 143).
    """

    exit_code = 130

    def __init__(self, message: str, *, signum: int, hint: str | None = None,
                 **details: object) -> None:
        super().__init__(message, hint=hint, signal=signum, **details)
        self.exit_code = 128 + signum
