"""An API key for every route: requests without it are answered 401."""

import hmac

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

OPEN_PATHS = ("/health",)


def require_api_key(app: FastAPI, key: str) -> None:
    """Answer 401 to any request (but `GET /health`) that does not carry `key`, as the
    Tinker SDK sends it (`X-API-Key: KEY`) or the OpenAI client does
    (`Authorization: Bearer KEY`)."""
    if not key:
        raise ValueError("the API key must not be empty")
    wanted = key.encode()

    @app.middleware("http")
    async def check_key(request: Request, call_next):
        if request.url.path in OPEN_PATHS:
            return await call_next(request)
        given = request.headers.get("x-api-key")
        if given is None:
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            given = token if scheme.lower() == "bearer" else None
        if given is None or not hmac.compare_digest(given.encode(), wanted):
            return JSONResponse({"detail": "missing or wrong API key (X-API-Key or Authorization: Bearer)",
                                 "error": {"message": "missing or wrong API key", "type": "authentication_error"}},
                                status_code=401)
        return await call_next(request)
