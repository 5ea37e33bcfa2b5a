"""A Google Cloud Storage emulator on this machine, for trying ``gs://`` work directories.

    python -m launch.gcs_emulator --port 9023 --bucket demo-bucket &
    export STORAGE_EMULATOR_HOST=http://127.0.0.1:9023
    python -m trainer --config configs/transformer_1024.py:tiny \\
        --workdir gs://demo-bucket/run --cpu_devices 8

Serves the ``gcp-storage-emulator`` package (``pip install -e '.[test]'``) from
memory on 127.0.0.1 with the bucket created; everything is gone when it
stops (Ctrl-C or SIGTERM). It prints ``ready`` once it accepts requests.

Object downloads answer as GCS does where the published package differs:

* they carry the object's generation (``x-goog-generation``): TensorStore,
  which writes Orbax's arrays, revalidates what it cached by generation and
  fails with "Malformed StorageGeneration" without it;
* a suffix range (``Range: bytes=-N``, the last N bytes) is honoured: riegeli
  reads an array_record file's footer so (a ``gs://`` TFDS ``data_dir``).

Uploads (``uploadType=media`` and ``multipart``) and deletes honour the
``ifGenerationMatch`` precondition as GCS does (412 when the object's generation
differs; ``0`` = the object must not exist), atomically: the work-directory lock
(trainer/workdir/lock.py) relies on it. The published package ignores it.
"""

from __future__ import annotations

import argparse
import logging
import re
import signal
import socket
import threading
from http import HTTPStatus

# One precondition check and its write at a time (the emulator serves requests on threads).
_PRECONDITIONS = threading.Lock()


def _as_gcs_downloads(download):
    """Wraps the emulator's download handler to answer as GCS does (see above)."""

    def handler(request, response, storage, *args, **kwargs):
        suffix = re.fullmatch(r"\s*bytes=-([0-9]+)\s*", request.get_header("range") or "")
        download(request, response, storage, *args, **kwargs)
        if response.status not in (HTTPStatus.OK, HTTPStatus.PARTIAL_CONTENT):
            return
        obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
        response["x-goog-generation"] = obj["generation"]
        response["x-goog-metageneration"] = obj["metageneration"]
        if suffix and response.status == HTTPStatus.OK:
            content = response._content  # the emulator's own buffer
            start = max(len(content) - int(suffix[1]), 0)
            response._content = content[start:]
            response.status = HTTPStatus.PARTIAL_CONTENT
            response["Content-Range"] = f"bytes {start}-{len(content) - 1}/{len(content)}"

    return handler


def _with_generation_precondition(handler, object_name):
    """Wraps an upload or delete handler to honour ``ifGenerationMatch``."""

    def wrapped(request, response, storage, *args, **kwargs):
        from gcp_storage_emulator.exceptions import NotFound  # noqa: PLC0415  (test extra)

        wanted = request.query.get("ifGenerationMatch")
        if not wanted:
            return handler(request, response, storage, *args, **kwargs)
        with _PRECONDITIONS:
            bucket = request.params["bucket_name"]
            try:
                current = str(storage.get_file_obj(bucket, object_name(request))["generation"])
            except NotFound:
                current = "0"
            if current != wanted[0]:
                response.status = HTTPStatus.PRECONDITION_FAILED
                response.json({"error": {"code": 412, "message": "conditionNotMet"}})
                return None
            return handler(request, response, storage, *args, **kwargs)

    return wrapped


def _upload_name(request) -> str:
    if "name" in request.query:
        return request.query["name"][0]
    return request.data["meta"]["name"]  # multipart: the name is in the metadata part


def serve(host: str, port: int, bucket: str):
    """Starts the emulator in a background thread; returns its server (``.stop()``).

    Raises:
      OSError: if the port is taken.
    """
    from gcp_storage_emulator import server  # noqa: PLC0415  (test extra, loaded on use)
    from gcp_storage_emulator.handlers import objects  # noqa: PLC0415

    # The emulator binds in its own thread and would wait forever for a port
    # that is taken: try it here first.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))
    original = objects.download
    objects.download = _as_gcs_downloads(original)  # `GET ...?alt=media` calls it by name
    replacements = {
        original: objects.download,
        objects.insert: _with_generation_precondition(objects.insert, _upload_name),
        objects.delete: _with_generation_precondition(
            objects.delete, lambda request: request.params["object_id"]
        ),
    }
    for _, methods in server.HANDLERS:
        for method, function in methods.items():
            methods[method] = replacements.get(function, function)
    logging.getLogger("gcp_storage_emulator").setLevel(logging.ERROR)
    emulator = server.create_server(host, port, in_memory=True, default_bucket=bucket)
    emulator.start()
    return emulator


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m launch.gcs_emulator",
        description=__doc__.split("\n")[0],
        epilog="example: python -m launch.gcs_emulator --port 9023 --bucket demo-bucket, then "
        "STORAGE_EMULATOR_HOST=http://127.0.0.1:9023 python -m trainer ... --workdir "
        "gs://demo-bucket/run",
    )
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to serve on (default %(default)s)"
    )
    parser.add_argument(
        "--port", type=int, default=9023, help="port to serve on (default %(default)s)"
    )
    parser.add_argument(
        "--bucket", default="demo-bucket", help="bucket to create (default %(default)s)"
    )
    args = parser.parse_args()
    try:
        emulator = serve(args.host, args.port, args.bucket)
    except ImportError:
        missing = "error: gcp-storage-emulator is missing: pip install -e '.[test]'"
        raise SystemExit(missing) from None
    except OSError as e:
        raise SystemExit(f"error: cannot serve on {args.host}:{args.port}: {e}") from None
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    print(f"ready: export STORAGE_EMULATOR_HOST=http://{args.host}:{args.port}", flush=True)
    stop.wait()
    emulator.stop()


if __name__ == "__main__":
    main()
