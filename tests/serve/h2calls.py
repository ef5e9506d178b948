"""Raw gRPC calls over HTTP/2 (the ``h2`` library) that a well-behaved client would never make: a
message announced at one size and sent in part, then nothing, to see what the server holds."""

from __future__ import annotations

import select
import socket
import struct
import time
import urllib.parse

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings

INFER = "/inference.GRPCInferenceService/ModelInfer"
STREAM_INFER = "/inference.GRPCInferenceService/ModelStreamInfer"


class PartialCalls:
    """``calls`` gRPC calls on one connection to ``address`` (``host:port``), each announcing a
    message of ``announce`` bytes and sending at most ``send`` of it, as fast as the server's
    flow control lets it.

    Attributes:
        sent: Bytes of message sent per stream id.
        ended: Per stream id that ended, its ``grpc-status`` (an int; -1 for a reset stream) and
            ``grpc-message``.
        max_streams: The server's SETTINGS_MAX_CONCURRENT_STREAMS, once received.
    """

    def __init__(self, address: str, calls: int, announce: int, send: int, metadata: tuple[tuple[str, str], ...] = (), path: str = INFER) -> None:
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)))
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.conn.initiate_connection()
        self.announce, self.send_most = announce, send
        self.sent: dict[int, int] = {}
        self.ended: dict[int, tuple[int, str]] = {}
        self.max_streams: int | None = None
        self._prefix: dict[int, bytes] = {}
        headers = [(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", address),
                   ("content-type", "application/grpc"), ("te", "trailers"), *metadata]
        for _ in range(calls):
            sid = self.conn.get_next_available_stream_id()
            self.conn.send_headers(sid, headers)
            self.sent[sid] = 0
            self._prefix[sid] = struct.pack(">BI", 0, announce)  # not compressed, the message's length
        self._flush()

    def pump(self, seconds: float) -> None:
        """Send what the windows allow and read what comes, for ``seconds`` (less once every call ended)."""
        end = time.monotonic() + seconds
        while time.monotonic() < end and len(self.ended) < len(self.sent):
            self._send_more()
            ready, _, _ = select.select([self.sock], [], [], 0.02)
            if ready:
                data = self.sock.recv(1 << 20)
                if not data:
                    for sid in self.sent:
                        self.ended.setdefault(sid, (-1, "connection closed"))
                    return
                self._receive(data)

    def open_calls(self) -> int:
        return len(self.sent) - len(self.ended)

    def close(self) -> None:
        self.sock.close()

    def _send_more(self) -> None:
        for sid in self.sent:
            while sid not in self.ended and self.sent[sid] < self.send_most:
                data = self._prefix.pop(sid, None)
                size = len(data) if data is not None else min(16384, self.send_most - self.sent[sid])
                try:
                    window = self.conn.local_flow_control_window(sid)
                except h2.exceptions.StreamClosedError:
                    break
                if window < size or size > self.conn.max_outbound_frame_size:
                    if data is not None:
                        self._prefix[sid] = data
                    break
                self.conn.send_data(sid, data if data is not None else b"\0" * size)
                if data is None:
                    self.sent[sid] += size
        self._flush()

    def _receive(self, data: bytes) -> None:
        for event in self.conn.receive_data(data):
            if isinstance(event, h2.events.RemoteSettingsChanged):
                setting = event.changed_settings.get(h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS)
                if setting is not None:
                    self.max_streams = setting.new_value
            elif isinstance(event, (h2.events.TrailersReceived, h2.events.ResponseReceived)):
                fields = {k.decode() if isinstance(k, bytes) else k: v.decode() if isinstance(v, bytes) else v for k, v in event.headers}
                if "grpc-status" in fields:  # trailers, or a trailers-only answer
                    self.ended[event.stream_id] = (int(fields["grpc-status"]), urllib.parse.unquote(fields.get("grpc-message", "")))
            elif isinstance(event, h2.events.StreamReset):
                self.ended.setdefault(event.stream_id, (-1, f"reset ({event.error_code})"))
        self._flush()

    def _flush(self) -> None:
        out = self.conn.data_to_send()
        if out:
            self.sock.sendall(out)
