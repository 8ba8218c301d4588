"""The holder side of the peer channel (see ``engines.wire``): an asyncio TCP server on
its own thread, bound to the node's address, answering ``Describe`` from the endpoint's
replicas, ``ReadBytes`` / ``ReadRanges`` (many ranges, one answer) from the memory it
serves (``engines.serve``, whatever the endpoint's engine), ``ReadDelta`` from two
replicas (``deltas.answer``, on the loop's executor), and ``Await`` from the
replica ``replica((model, version))`` finds: it awaits ``Replica.await_held`` (woken by
``Replica.mark_held``, or ``mark_landed`` for an ask with ``after``; never polled) for
at most the ask's ``timeout_s``, capped at ``await_cap_s`` (default ``AWAIT_CAP_S``, 30
s, well inside ``idle_s``); a server built without ``replica`` refuses every ``Await``
as ``not_found``. ``on_ask`` (optional) is called on the server's thread with every
authenticated ask, after ``last_ask`` is set (the endpoint speeds its engine's serving
up at once: ``service``); it must be quick. A connection is closed after an ask
refused for its frame or token (too large, malformed, auth; an answer that refuses
what was asked, ``not_found`` or ``bad_request``, leaves it open); an idle connection is closed after ``idle_s``
(default ``IDLE_S``, 300 s: readers' tcp engines drop their pooled connections well
before, ``engines.tcp.IDLE_S``), and one whose reader stops receiving after
``send_timeout_s`` (``engines.serve.SEND_TIMEOUT_S``, 30 s) per slice.
``close(timeout)`` stops accepting, ends every connection, and waits up to ``timeout``
(default 5 s) for the server thread to end."""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
import math
import time
from typing import Callable, Optional

from ..engines import wire
from ..engines.serve import SEND_TIMEOUT_S, Regions, serve_read
from . import deltas
from .replica import Replica

log = logging.getLogger("tensorhub.peer")
IDLE_S = 300.0
AWAIT_CAP_S = 30.0


class PeerServer:
    def __init__(self, host: str, token: str, describe: Callable[[wire.Describe], wire.Described | wire.Refused],
                 regions: Regions, *, idle_s: float = IDLE_S, send_timeout_s: float = SEND_TIMEOUT_S,
                 replica: Optional[Callable[[tuple[str, int]], Optional[Replica]]] = None,
                 await_cap_s: float = AWAIT_CAP_S, on_ask: Optional[Callable[[], None]] = None):
        self._token = token.encode()
        self._on_ask = on_ask
        self._replica = replica
        self._await_cap_s = await_cap_s
        self._describe = describe
        self._regions = regions
        self._idle_s = idle_s
        self._send_timeout_s = send_timeout_s
        self.last_ask = float("-inf")  # when a peer last asked us anything (the service's pace)
        self._loop = asyncio.new_event_loop()
        self._server = self._loop.run_until_complete(asyncio.start_server(self._serve, host, 0))
        self.address = f"{host}:{self._server.sockets[0].getsockname()[1]}"
        self._thread = threading.Thread(target=self._loop.run_forever, name="th-peer", daemon=True)
        self._thread.start()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await asyncio.wait_for(reader.readexactly(4), self._idle_s)
                n = int.from_bytes(head, "big")
                if n > wire.MAX_ASK:
                    await self._refuse(writer, "too_large", f"ask of {n} bytes exceeds {wire.MAX_ASK}")
                    return
                try:
                    ask = wire.decode_ask(await reader.readexactly(n))
                except Exception as exc:
                    await self._refuse(writer, "malformed", f"undecodable ask: {exc}")
                    return
                if ask.v != wire.WIRE_VERSION or not hmac.compare_digest(ask.token.encode(), self._token):
                    await self._refuse(writer, "auth", "bad token or peer wire version")
                    return
                self.last_ask = time.monotonic()
                if self._on_ask is not None:
                    self._on_ask()
                if isinstance(ask.op, (wire.ReadBytes, wire.ReadRanges)):
                    await serve_read(writer, self._regions, ask.op, send_timeout=self._send_timeout_s)
                elif isinstance(ask.op, wire.Await):
                    writer.write(wire.frame(wire.Answer(body=await self._await(ask.op))))
                    await writer.drain()
                elif isinstance(ask.op, wire.ReadDelta):
                    await self._delta(writer, ask.op)
                else:
                    writer.write(wire.frame(wire.Answer(body=self._describe(ask.op))))
                    await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.TimeoutError, ConnectionError):
            pass
        except asyncio.CancelledError:  # ``close``: ending normally spares the stream's callback an error log
            pass
        except Exception:
            log.exception("peer connection failed")
        finally:
            writer.close()

    async def _await(self, ask: wire.Await) -> wire.Have | wire.Refused:
        what = f"{ask.model}@{ask.version}"
        held = self._replica((ask.model, ask.version)) if self._replica is not None else None
        if held is None:
            return wire.Refused(code="not_found", message=f"this endpoint holds no replica of {what}")
        mask = wire.mask_int(ask.chunks)
        if not mask:
            return wire.Refused(code="bad_request", message=f"await of {what}: chunks names no chunk")
        n = held.chunk_count()
        if n is not None and mask >> n:
            return wire.Refused(code="bad_request", message=f"await of {what}: chunks names chunk "
                                f"{mask.bit_length() - 1}, past the version's {n} chunks")
        if not (math.isfinite(ask.timeout_s) and ask.timeout_s >= 0):
            return wire.Refused(code="bad_request", message=f"await of {what}: timeout_s must be a finite "
                                f"number >= 0, not {ask.timeout_s}")
        if ask.after is not None and any(not mask >> c & 1 or n < 0 for c, n in ask.after.items()):
            return wire.Refused(code="bad_request", message=f"await of {what}: after names a chunk not in "
                                f"chunks, or bytes below 0")
        fut = held.await_held(mask, asyncio.get_running_loop(), ask.after)
        try:
            got = await asyncio.wait_for(fut, min(ask.timeout_s, self._await_cap_s))
        except asyncio.TimeoutError:
            got = 0 if ask.after is None else (0, {})
        finally:
            held.forget(fut)
        if got is None:
            return wire.Refused(code="not_found", message=f"the replica of {what} was dropped")
        if ask.after is None:
            return wire.Have(chunks=wire.mask_bytes(got))
        return wire.Have(chunks=wire.mask_bytes(got[0]), landed=got[1])

    async def _delta(self, writer: asyncio.StreamWriter, ask: wire.ReadDelta) -> None:
        if self._replica is None:
            head, payload = wire.Refused(code="not_found", message="this endpoint serves no deltas"), b""
        else:  # the encode is CPU work: off the loop, which serves every other ask
            head, payload = await asyncio.get_running_loop().run_in_executor(
                None, deltas.answer, self._replica, ask)
        writer.write(wire.frame(wire.Answer(body=head)))
        if payload:
            writer.write(payload)
        await asyncio.wait_for(writer.drain(), self._send_timeout_s * max(1, len(payload) >> 24))

    @staticmethod
    async def _refuse(writer: asyncio.StreamWriter, code: str, message: str) -> None:
        writer.write(wire.frame(wire.Answer(body=wire.Refused(code=code, message=message))))
        await writer.drain()

    def close(self, timeout: float = 5.0) -> None:
        """No new connection is accepted once this returns. Waits up to ``timeout`` for
        the listener to close and again for the server thread to end."""
        async def stop() -> None:
            self._server.close()
            # Connections end here, on the loop: left pending, each would be destroyed
            # later by the garbage collector on whatever thread, raising "Event loop is
            # closed" from its ``finally`` (and formatting that traceback concurrently
            # with other threads' ast use trips a CPython 3.11 race).
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._server.wait_closed()

        if self._loop.is_running():
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout=timeout)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=timeout)
        if not self._thread.is_alive() and not self._loop.is_closed():
            self._loop.close()
