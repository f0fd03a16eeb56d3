"""Django's admin autodiscovery imports this module: the console's pages
(`dispatch.console.admin`) register themselves on the default admin site."""

from dispatch.console.admin import (  # noqa: F401
    AttemptAdmin,
    DatasourceAdmin,
    JobAdmin,
    JobBindingAdmin,
    OverviewAdmin,
    RunAdmin,
    WorkerAdmin,
)
from dispatch.console.tokens import ApiTokenAdmin  # noqa: F401
