"""API tokens in the console: created (the token is shown once, on the page that answers
the save, and never again), listed with their state, and revoked.

A user who is not a superuser sees and creates only tokens of their own: a token carries
its user's permissions, so one made for another user would be a way to borrow theirs. The
hash is never shown; the public prefix names a token in the list.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django import forms
from django.contrib import admin
from django.db.models import QuerySet
from django.db.models.functions import Now
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.utils import timezone
from django.utils.html import format_html
from django.utils.safestring import SafeString

from dispatch.console.actions import ActionResult, ActionSpec
from dispatch.console.admin import ConsoleAdmin, changelist_action
from dispatch.core import conf
from dispatch.models import ApiToken
from dispatch.models.tokens import TOKEN_PREFIX
from dispatch.services import ActionRefused

# A new token's expiry unless the form says otherwise.
DEFAULT_DAYS = 90
# A token's identity, owner, lifetime and scope are fixed once it exists: a change is a
# new token (and the old one revoked). Its change page shows these read-only, its name
# editable.
FIXED_FIELDS = (
    "user",
    "public_prefix",
    "state",
    "created_at",
    "expires_at",
    "last_used_at",
    "revoked_at",
    "bindings",
)


def _revoke(request: HttpRequest, token: ApiToken) -> ActionResult:
    # A conditional update: a token revoked twice at once is revoked once.
    done = ApiToken.objects.filter(pk=token.pk, revoked_at__isnull=True).update(revoked_at=Now())
    if not done:
        raise ActionRefused("ALREADY_REVOKED", f"{token} is already revoked.")
    return ActionResult("REVOKED")


REVOKE = ActionSpec(
    "revoke_token",
    "Revoke",
    "dispatch.change_apitoken",
    True,
    _revoke,
    "Refuse the token from now on (401). A revoked token is never valid again; create a new one.",
    applies=lambda token: token.revoked_at is None,
)


class ApiTokenForm(forms.ModelForm):  # type: ignore[type-arg]
    class Meta:
        model = ApiToken
        fields = ["name", "user", "expires_at", "bindings"]

    def clean_expires_at(self) -> Any:
        value = self.cleaned_data["expires_at"]
        now = timezone.now()
        most = conf.api_token_max_days()
        if value <= now:
            raise forms.ValidationError("The expiry must be in the future.")
        if value > now + timedelta(days=most):
            raise forms.ValidationError(
                f"A token lives at most {most} days (DISPATCH_API_TOKEN_MAX_DAYS)."
            )
        return value


class ApiTokenAdmin(ConsoleAdmin):
    form = ApiTokenForm
    list_display = ["name", "user", "public_prefix", "state", "expires_at", "last_used_at"]
    list_filter = ["revoked_at"]
    search_fields = ["name", "prefix", "user__username"]
    list_select_related = ["user"]
    filter_horizontal = ["bindings"]
    actions = [changelist_action(REVOKE, "change")]
    object_actions = (REVOKE,)

    def get_queryset(self, request: HttpRequest) -> QuerySet[ApiToken]:
        qs = super().get_queryset(request)
        if not request.user.is_superuser:
            qs = qs.filter(user=request.user)
        return qs

    def get_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        if obj is not None:
            return ["name", *FIXED_FIELDS]
        if request.user.is_superuser:
            return ["name", "user", "expires_at", "bindings"]
        return ["name", "expires_at", "bindings"]

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        if obj is None:
            return []
        return list(FIXED_FIELDS)

    def get_changeform_initial_data(self, request: HttpRequest) -> dict[str, Any]:
        days = min(DEFAULT_DAYS, conf.api_token_max_days())
        return {"expires_at": timezone.now() + timedelta(days=days), "user": request.user.pk}

    def save_model(self, request: HttpRequest, obj: ApiToken, form: Any, change: bool) -> None:
        if not change:
            if not request.user.is_superuser:
                obj.user = request.user  # type: ignore[assignment]
            # The only moment the token exists in clear: kept on the instance for the
            # page that answers this request (response_add), never stored.
            obj._plain_token = obj.new_secret()  # type: ignore[attr-defined]
        super().save_model(request, obj, form, change)

    def save_related(self, request: HttpRequest, form: Any, formsets: Any, change: bool) -> None:
        super().save_related(request, form, formsets, change)
        if not change:
            # Narrowed for good when created with bindings (see ApiToken.scoped).
            scoped = form.instance.bindings.exists()
            ApiToken.objects.filter(pk=form.instance.pk).update(scoped=scoped)
            form.instance.scoped = scoped

    def response_add(
        self, request: HttpRequest, obj: ApiToken, post_url_continue: str | None = None
    ) -> HttpResponse:
        token = getattr(obj, "_plain_token", None)
        if token is None:  # pragma: no cover - save_model always sets it
            return super().response_add(request, obj, post_url_continue)
        context = {
            **self.admin_site.each_context(request),
            "title": "API token created",
            "opts": self.opts,
            "token": token,
            "object": obj,
        }
        response = TemplateResponse(request, "admin/dispatch/apitoken/created.html", context)
        # Shown once: no cache (browser or proxy) may keep the page.
        response["Cache-Control"] = "no-store"
        return response

    @admin.display(description="token")
    def public_prefix(self, obj: ApiToken) -> str:
        return f"{TOKEN_PREFIX}{obj.prefix}_…"

    @admin.display(description="state")
    def state(self, obj: ApiToken) -> SafeString:
        if obj.revoked_at is not None:
            return format_html('<span class="dsp-badge dsp-failed">{}</span>', "revoked")
        if obj.expires_at <= timezone.now():
            return format_html('<span class="dsp-badge dsp-cancelled">{}</span>', "expired")
        return format_html('<span class="dsp-badge dsp-succeeded">{}</span>', "active")


admin.site.register(ApiToken, ApiTokenAdmin)
