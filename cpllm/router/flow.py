"""One request through the router, as vLLM's disaggregated proxy drives the instances: the prefill instance gets
it with max_tokens 1 and `kv_transfer_params: {"do_remote_decode": true}` and answers where the prompt's K/V is
held; the decode instance gets the original request with that answer and generates (streaming if asked).

Faults: a prefill instance that cannot be reached or fails (a 5xx) is marked down and the request goes to the
next one; a 4xx is the request's own fault and goes back to the client as is. A decode instance that cannot be
reached (the connection was refused: it never saw the request) is tried after the next one the same way; one
that fails after it took the request is not retried (it may have pulled the K/V and begun generating), and the
client gets an error naming it. The prefill side frees the blocks nobody pulled at its abort timeout."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx

from cpllm.router.instances import Instance, Pool


class RouteError(Exception):
    """The request cannot be served; the client gets `status` with an OpenAI error naming every failure."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message

    def body(self) -> dict:
        kind = "service_unavailable" if self.status == 503 else "bad_gateway"
        return {"error": {"message": self.message, "type": kind, "param": None, "code": self.status}}


class Passed(Exception):
    """An instance's own error answer (a 4xx, or the decode instance's 5xx), handed to the client unchanged."""

    def __init__(self, status: int, content: bytes, content_type: str):
        super().__init__(status)
        self.status, self.content, self.content_type = status, content, content_type


def prefill_body(body: dict) -> dict:
    """The prefill instance's request: one token, no stream, and the ask to hold the prompt's blocks."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "min_tokens")}
    out.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    if "max_completion_tokens" in body:
        out["max_completion_tokens"] = 1
    return out


def _error_text(response: httpx.Response) -> str:
    try:
        return str(response.json().get("error", {}).get("message") or response.text)[:300]
    except (ValueError, AttributeError):
        return response.text[:300]


def _failure(error: httpx.HTTPError) -> str:
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


async def prefill(client: httpx.AsyncClient, pool: Pool, path: str, body: dict, headers: dict) -> dict:
    """The prefill instance's kv_transfer_params, from the first instance that answers; every instance is tried
    at most once. RouteError (503) names each failure when none could; Passed for a 4xx."""
    failures = []
    for instance in pool.order():
        instance.in_flight += 1
        instance.sent += 1
        try:
            response = await client.post(f"{instance.url}{path}", json=prefill_body(body), headers=headers)
        except httpx.HTTPError as error:
            failures.append(f"{instance.url}: {_failure(error)}")
            instance.mark_down(failures[-1])
            continue
        finally:
            instance.in_flight -= 1
        if 400 <= response.status_code < 500:
            raise Passed(response.status_code, response.content, response.headers.get("content-type", ""))
        if response.status_code != 200:
            failures.append(f"{instance.url}: {response.status_code} {_error_text(response)}")
            instance.mark_down(failures[-1])
            continue
        params = response.json().get("kv_transfer_params")
        if not params or not params.get("do_remote_prefill"):
            failures.append(f"{instance.url} answered without kv_transfer_params (start it with "
                            "--kv-transfer-config and kv_role kv_producer or kv_both)")
            continue
        return params
    raise RouteError(503, "no prefill instance could serve the request: " + "; ".join(failures))


async def open_decode(client: httpx.AsyncClient, pool: Pool, path: str, body: dict, headers: dict,
                      params: dict) -> tuple[Instance, httpx.Response]:
    """The decode instance's open response (its body not read yet) and the instance, counted in flight until
    `close_decode`. Only instances that refused the connection are skipped for the next."""
    request_body = {**body, "kv_transfer_params": params}
    failures = []
    for instance in pool.order():
        instance.in_flight += 1
        instance.sent += 1
        request = client.build_request("POST", f"{instance.url}{path}", json=request_body, headers=headers)
        try:
            response = await client.send(request, stream=True)
        except (httpx.ConnectError, httpx.ConnectTimeout) as error:  # it never got the request
            instance.in_flight -= 1
            failures.append(f"{instance.url}: {_failure(error)}")
            instance.mark_down(failures[-1])
            continue
        except httpx.HTTPError as error:  # it may have taken the request: not sent to another
            instance.in_flight -= 1
            instance.mark_down(f"{_failure(error)}")
            raise RouteError(502, f"decode instance {instance.url} failed: {_failure(error)}") from error
        if response.status_code != 200:
            content = await response.aread()
            await close_decode(instance, response)
            raise Passed(response.status_code, content, response.headers.get("content-type", ""))
        return instance, response
    raise RouteError(503, "no decode instance could serve the request: " + "; ".join(failures))


async def close_decode(instance: Instance, response: httpx.Response) -> None:
    instance.in_flight -= 1
    await response.aclose()


async def relay(instance: Instance, response: httpx.Response) -> AsyncIterator[bytes]:
    """The decode instance's stream, chunk by chunk; an instance that dies mid-stream ends it with an error event
    naming it (the client keeps the tokens it got: nothing is sent twice)."""
    try:
        async for chunk in response.aiter_raw():
            yield chunk
    except httpx.HTTPError as error:
        instance.mark_down(_failure(error))
        message = f"decode instance {instance.url} failed mid-stream: {_failure(error)}"
        yield f"data: {json.dumps(RouteError(502, message).body())}\n\n".encode()
    finally:
        await close_decode(instance, response)
