from __future__ import annotations

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
application = get_wsgi_application()

# Register schedules once the application is built (never in AppConfig.ready(): migrate
# must work on an empty database). It runs in the background and only logs a failure, so
# a database that is down does not stop the site; the reconciler registers them anyway.
from scheduling.reconciler import register_at_startup  # noqa: E402

register_at_startup()
