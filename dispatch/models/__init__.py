"""dispatch's models: the core tables (datasources, jobs, bindings, runs, attempts,
cursors, workers), the operations tables (health, alerts, metrics, maintenance
cursors), bulk operations and the HTTP API's tokens. Django finds every model through this package; import them from here."""

from dispatch.models.bulk import BulkOperation, BulkSkip, BulkStatus
from dispatch.models.core import (
    MANAGED_BY_FILES,
    MAX_JSON_BYTES,
    SECRET_MASK,
    Attempt,
    BindingCursor,
    Datasource,
    Job,
    JobBinding,
    Overview,
    Run,
    Slice,
    SlicePlan,
    Worker,
    check_json_size,
    redact,
)
from dispatch.models.ops import (
    MAX_ALERT_RECIPIENTS,
    Alert,
    AlertKind,
    AlertStatus,
    BindingHealth,
    BindingMetrics,
    HealthState,
    OpsState,
)
from dispatch.models.tokens import ApiToken

__all__ = [
    "MANAGED_BY_FILES",
    "MAX_ALERT_RECIPIENTS",
    "MAX_JSON_BYTES",
    "SECRET_MASK",
    "Alert",
    "ApiToken",
    "AlertKind",
    "AlertStatus",
    "Attempt",
    "BindingCursor",
    "BindingHealth",
    "BindingMetrics",
    "BulkOperation",
    "BulkSkip",
    "BulkStatus",
    "Datasource",
    "HealthState",
    "Job",
    "JobBinding",
    "OpsState",
    "Overview",
    "Run",
    "Slice",
    "SlicePlan",
    "Worker",
    "check_json_size",
    "redact",
]
