"""A request whose bytes do not decode is INVALID_ARGUMENT, not UNKNOWN.

grpc decodes a request with the method's deserializer before the handler runs and answers a decode error with
UNKNOWN ("Unexpected DecodeError"), a status that says "the server failed". :class:`DecodeInHandler` moves the
decoding into the handler, where a message that does not parse is refused as the caller's error."""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

Deserializer = Callable[[bytes], Any]


class DecodeInHandler(grpc.aio.ServerInterceptor):
    """Server interceptor: every method receives raw bytes and decodes them itself (INVALID_ARGUMENT on error)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        decode: Deserializer = handler.request_deserializer
        serialize = handler.response_serializer
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _unary(handler.unary_unary, decode), response_serializer=serialize
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _unary_stream(handler.unary_stream, decode), response_serializer=serialize
            )
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(
                _stream_unary(handler.stream_unary, decode), response_serializer=serialize
            )
        return grpc.stream_stream_rpc_method_handler(
            _stream_stream(handler.stream_stream, decode), response_serializer=serialize
        )


async def _decode(raw: bytes, decode: Deserializer, context: grpc.aio.ServicerContext) -> Any:
    try:
        return decode(raw)
    except Exception as exc:  # whatever the decoder raises, the bytes were the caller's error
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the request does not decode: {type(exc).__name__}")


def _unary(behavior: Any, decode: Deserializer) -> Any:
    async def call(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        return await behavior(await _decode(raw, decode, context), context)

    return call


def _unary_stream(behavior: Any, decode: Deserializer) -> Any:
    if not inspect.isasyncgenfunction(behavior):  # a coroutine that writes with context.write (health Watch)
        return _unary(behavior, decode)

    async def call(raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async for item in behavior(await _decode(raw, decode, context), context):
            yield item

    return call


async def _decoded(
    requests: AsyncIterator[bytes], decode: Deserializer, context: grpc.aio.ServicerContext
) -> AsyncIterator[Any]:
    async for raw in requests:
        yield await _decode(raw, decode, context)


def _stream_unary(behavior: Any, decode: Deserializer) -> Any:
    # grpc awaits the behaviour only when it is a coroutine function: this wrapper must be one
    async def call(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> Any:
        return await behavior(_decoded(requests, decode, context), context)

    return call


def _stream_stream(behavior: Any, decode: Deserializer) -> Any:
    if not inspect.isasyncgenfunction(behavior):
        return _stream_unary(behavior, decode)

    async def call(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async for item in behavior(_decoded(requests, decode, context), context):
            yield item

    return call
