"""The routes an operator's tools call: ``/health`` and Prometheus' ``/metrics`` (never behind
the API key)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from inferscale_apps.server.metrics import CONTENT_TYPE_LATEST
from inferscale_apps.server.state import State

router = APIRouter()


@router.get("/health")
async def health(state: State) -> Response:
    if getattr(state.engine, "closed", False):
        return JSONResponse({"status": "closed"}, status_code=503)
    return JSONResponse({"status": "ok", "model": state.model_name})


@router.get("/metrics")
async def prometheus(state: State) -> Response:
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
