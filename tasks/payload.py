"""The rows a load replays: a version's golden inputs, shaped as Triton requests.

Used by the canary and by ``modelship load``. The source is returned with the rows so a
report can say whether they were the model's own golden rows or synthetic ones.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from model_registry.client import RegistryClient
from model_registry.golden import load_golden
from modelship.repository import staged_config
from modelship.storage import S3Storage
from modelship.triton.model_config import example_request
from tasks.export import golden_feed
from tasks.validate import spec_of_config


def load_payload(storage: S3Storage, registry: RegistryClient | None, *,
                 repository_prefix: str, model: str, version: int,
                 rows: int = 64) -> tuple[dict[str, np.ndarray], str]:
    """Rows to replay: the version's golden inputs when MLflow has them, else random rows
    shaped by the staged config.

    Returns:
        Input name to a batch-first array, and the rows' source (``artifact``,
        ``input_example`` or ``synthetic``).
    """
    config = staged_config(storage, repository_prefix=repository_prefix, model=model,
                           version=version)
    if registry is None:
        return example_request(config, rows=rows, random=True), "synthetic"
    with tempfile.TemporaryDirectory(prefix="modelship-load-") as tmp:
        resolved = registry.resolve(model, version=version, download_dir=Path(tmp))
        info, golden = load_golden(registry, resolved, workdir=Path(tmp) / "g",
                                   max_rows=rows, allow_synthetic=True)
        return golden_feed(golden, spec_of_config(config), resolved.signature), info.source
