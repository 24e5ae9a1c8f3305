"""The load generator, moving from one module into a package (issue 19 item 6).

Transitional: ``engine.py`` is the old ``modelship/loadgen.py`` renamed so that its history
follows; the next commit carves it into spec, stats, engine and transports.
"""

from modelship.loadgen.engine import *  # noqa: F403 - transitional, see the docstring
from modelship.loadgen.engine import (  # noqa: F401 - transitional, see the docstring
    _GrpcTransport,
    _header,
    _http_address,
    _HttpConnection,
    _HttpTransport,
    _model_version,
    _RawGrpcTransport,
    _transport,
)
