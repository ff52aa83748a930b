"""``/v1/webhook_endpoints``: OpenAI's webhook endpoints API (the SDK's ``client.webhooks``), scoped
to the caller's tenant, and slotq's own ``GET /v1/webhook_endpoints/{id}/attempts``: the recent
delivery attempts of an endpoint (:mod:`slotq.jobs.gateway.webhooks` says what is sent and how)."""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Body, Depends, Query, Request
from pydantic import BaseModel, ValidationError

from slotq.jobs.gateway.auth import CallerDep, authenticate
from slotq.jobs.gateway.webhooks import (
    CreateWebhookEndpoint,
    DeletedWebhookEndpoint,
    DeliveryAttemptList,
    EventTypeList,
    RotateSecret,
    UpdateWebhookEndpoint,
    WebhookEndpoint,
    WebhookEndpointList,
    WebhookEndpointWithSecret,
    WebhookStore,
)
from slotq.jobs.openai.errors import from_validation

router = APIRouter(prefix="/v1/webhook_endpoints", dependencies=[Depends(authenticate)])
event_types = APIRouter(dependencies=[Depends(authenticate)])


def webhooks_of(request: Request) -> WebhookStore:
    store: WebhookStore = request.app.state.webhooks
    return store


M = TypeVar("M", bound=BaseModel)


def _body(model: type[M], payload: dict[str, Any]) -> M:
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        raise from_validation(exc) from None


@router.post("")
async def create_endpoint(request: Request, payload: Annotated[dict[str, Any], Body()],
                          caller: CallerDep) -> WebhookEndpointWithSecret:
    """The answer carries ``signing_secret``: the only time it is shown."""
    endpoint = await webhooks_of(request).create(_body(CreateWebhookEndpoint, payload), caller.tenant)
    return endpoint.with_secret()


@router.get("")
async def list_endpoints(request: Request, caller: CallerDep, after: str | None = None,
                         limit: Annotated[int, Query(ge=1, le=100)] = 20) -> WebhookEndpointList:
    return await webhooks_of(request).list(caller.tenant, limit=limit, after=after)


@router.get("/{webhook_endpoint_id}")
async def get_endpoint(webhook_endpoint_id: str, request: Request, caller: CallerDep) -> WebhookEndpoint:
    return await webhooks_of(request).get(webhook_endpoint_id, caller.tenant)


@router.post("/{webhook_endpoint_id}")
async def update_endpoint(webhook_endpoint_id: str, request: Request, payload: Annotated[dict[str, Any], Body()],
                          caller: CallerDep) -> WebhookEndpoint:
    return await webhooks_of(request).update(webhook_endpoint_id, caller.tenant,
                                             _body(UpdateWebhookEndpoint, payload))


@router.post("/{webhook_endpoint_id}/rotate_secret")
async def rotate_secret(webhook_endpoint_id: str, request: Request, caller: CallerDep,
                        payload: Annotated[dict[str, Any] | None, Body()] = None) -> WebhookEndpointWithSecret:
    """A new ``signing_secret``, shown this once. ``keep_old_secret_active_for_24_hours``: deliveries
    carry a second signature, with the old secret, for 24 hours."""
    body = _body(RotateSecret, payload or {})
    endpoint = await webhooks_of(request).rotate_secret(webhook_endpoint_id, caller.tenant,
                                                        keep_old=body.keep_old_secret_active_for_24_hours)
    return endpoint.with_secret()


@router.delete("/{webhook_endpoint_id}")
async def delete_endpoint(webhook_endpoint_id: str, request: Request, caller: CallerDep) -> DeletedWebhookEndpoint:
    """Its pending deliveries are dropped; its attempts are forgotten."""
    return await webhooks_of(request).delete(webhook_endpoint_id, caller.tenant)


@router.get("/{webhook_endpoint_id}/attempts")
async def list_attempts(webhook_endpoint_id: str, request: Request, caller: CallerDep,
                        limit: Annotated[int, Query(ge=1, le=100)] = 20) -> DeliveryAttemptList:
    """The endpoint's most recent delivery attempts, newest first (its last 100 are kept): status
    code or error, and when the next attempt is due."""
    return await webhooks_of(request).attempts(webhook_endpoint_id, caller.tenant, limit)


@event_types.get("/v1/webhook_event_types")
async def list_event_types() -> EventTypeList:
    return EventTypeList()
