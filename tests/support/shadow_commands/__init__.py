"""A stand-in for an app listed before dispatch that has a `runworker` of its own (Django
Channels does): its command is the one `manage.py runworker` runs (dispatch.W003)."""
