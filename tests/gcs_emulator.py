"""gcp-storage-emulator with the one GCS rule it leaves out that study claims rely on: an object
insert with `ifGenerationMatch` fails with 412 Precondition Failed unless the object's live
generation matches (0: no live object). The emulator (2026.x) ignores the parameter: a second
insert with ifGenerationMatch=0 replaced the object (checked in test_study.py). Its HTTP server
answers one request at a time, so the check and the insert below are one step, as in GCS.

    python tests/gcs_emulator.py start --host 127.0.0.1 --port P --in-memory --default-bucket B
"""
import sys
from http import HTTPStatus

from gcp_storage_emulator import __main__ as emulator
from gcp_storage_emulator.exceptions import NotFound
from gcp_storage_emulator.handlers import objects


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


objects._media_upload = _with_precondition(objects._media_upload)
objects._multipart_upload = _with_precondition(objects._multipart_upload)

if __name__ == "__main__":
    sys.exit(emulator.main())
