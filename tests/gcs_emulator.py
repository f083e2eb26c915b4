"""gcp-storage-emulator made to serve as GCS does in the two ways study claims and the fault tests
rely on.

- An object insert with `ifGenerationMatch` fails with 412 Precondition Failed unless the
  object's live generation matches (0: no live object). The emulator (2026.x) ignores the
  parameter: a second insert with ifGenerationMatch=0 replaced the object (checked in
  test_study.py).
- Requests are served concurrently. The emulator's HTTP server answers one connection at a time,
  so a client stopped (SIGSTOP) halfway through sending a request stalled every other client until
  it was continued: a frozen holder took the storage of the holder taking over down with it, which
  GCS never does. Here each connection has its own thread; a request's body is read in that
  thread, and only the handling (the storage's lookups and changes) holds one lock, so the
  precondition's check and the insert are still one step, as in GCS, and the answer is written
  after the lock is let go.

    python tests/gcs_emulator.py start --host 127.0.0.1 --port P --in-memory --default-bucket B
"""
import sys
import threading
from functools import partial
from http import HTTPStatus
from http.server import ThreadingHTTPServer

from gcp_storage_emulator import __main__ as emulator
from gcp_storage_emulator import server
from gcp_storage_emulator.exceptions import NotFound
from gcp_storage_emulator.handlers import objects

_HANDLING = threading.RLock()
"""Held while a handler looks at or changes the storage (reentrant: a handler may call another)."""


def _with_precondition(upload):
    def checked(request, response, storage):
        wanted = request.query.get("ifGenerationMatch")
        if wanted:
            name = request.query["name"][0] if "name" in request.query else request.data["meta"].get("name")
            try:
                live = storage.get_file_obj(request.params["bucket_name"], name)["generation"]
            except NotFound:
                live = "0"
            if str(live) != wanted[0]:
                response.status = HTTPStatus.PRECONDITION_FAILED
                response.json({"error": {"code": 412, "message": "At least one of the pre-conditions you "
                                         "specified did not hold.", "errors": [{"reason": "conditionNotMet"}]}})
                return None
        return upload(request, response, storage)
    return checked


def _one_at_a_time(handler):
    def handled(request, response, storage):
        _ = request.data  # the body, read off this connection before the lock is taken
        with _HANDLING:
            return handler(request, response, storage)
    return handled


def _threaded_run(self):
    self._httpd = ThreadingHTTPServer((self._host, self._port), partial(server.RequestHandler, self._storage))
    self._httpd.daemon_threads = True
    self.is_running.set()
    self._httpd.serve_forever()


objects._media_upload = _with_precondition(objects._media_upload)
objects._multipart_upload = _with_precondition(objects._multipart_upload)
for _pattern, _handlers in server.HANDLERS:
    for _method, _handler in list(_handlers.items()):
        _handlers[_method] = _one_at_a_time(_handler)
objects.insert = _one_at_a_time(objects.insert)  # the router's fallback for uploads posted without /upload
server.APIThread.run = _threaded_run

if __name__ == "__main__":
    sys.exit(emulator.main())
