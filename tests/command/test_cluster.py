"""Joining a job: each managed environment JAX knows, mocked by its variables or
its metadata server, and what reaches ``jax.distributed.initialize``."""

import http.server
import json
import os
import subprocess
import sys
import threading

import jax
import pytest
import requests
from conftest import REPO, command_env
from jax._src import cloud_tpu_init
from jax._src.clusters import cloud_tpu_cluster
from jax._src.clusters import cluster as jax_cluster

from launch.local import free_port
from trainer import jax_internals
from trainer.command import cluster
from trainer.errors import ConfigError

_PREFIXES = ("SLURM_", "OMPI_", "TPU_", "MEGASCALE_", "JAX_COORDINATOR", "JAX_LOCAL_DEVICE")


@pytest.fixture(autouse=True)
def bare_machine(monkeypatch):
    """No scheduler variables, and any HTTP request is a failure."""
    for name in list(os.environ):
        if name.startswith(_PREFIXES) or name in ("KUBERNETES_SERVICE_HOST", "GCE_METADATA_IP"):
            monkeypatch.delenv(name)

    def no_http(*args, **kwargs):
        raise AssertionError(f"unexpected HTTP request {args}")

    monkeypatch.setattr(requests, "get", no_http)


@pytest.fixture
def tpu_vm(monkeypatch):
    """What JAX concludes at import on a Cloud TPU VM (chips on the PCI bus)."""
    for module in (cloud_tpu_init, cloud_tpu_cluster, jax_cluster):
        monkeypatch.setattr(module, "running_in_cloud_tpu_vm", True)
    # JAX sets this at import on machines without TPU chips.
    monkeypatch.delenv("TPU_SKIP_MDS_QUERY", raising=False)


def test_a_moved_private_name_is_named(monkeypatch):
    monkeypatch.setitem(jax_internals.PRIVATE, "cluster types", ("jax._src.clusters", "Gone.x"))
    with pytest.raises(RuntimeError, match=r"jax\._src\.clusters\.Gone\.x.*--coordinator_address"):
        cluster.detect()


def test_a_laptop_starts_nothing_and_asks_no_metadata_server():
    assert cluster.detect() is None


def slurm_env(monkeypatch, *, tasks, nodes, procid, localid):
    monkeypatch.setenv("SLURM_JOB_ID", "1234")
    monkeypatch.setenv("SLURM_STEP_NODELIST", "gpu[003-004]")
    monkeypatch.setenv("SLURM_NTASKS", str(tasks))
    monkeypatch.setenv("SLURM_STEP_NUM_NODES", str(nodes))
    monkeypatch.setenv("SLURM_PROCID", str(procid))
    monkeypatch.setenv("SLURM_LOCALID", str(localid))


def test_slurm_one_task_per_node_uses_every_gpu(monkeypatch):
    slurm_env(monkeypatch, tasks=2, nodes=2, procid=1, localid=0)
    # Port: JAX's rule, job id 1234 mod 4096 into the top 4096 ports.
    assert cluster.detect() == cluster.Job("slurm", "gpu003:62674", 2, 1, None)


def test_slurm_one_task_per_gpu_takes_the_gpu_of_its_local_rank(monkeypatch):
    slurm_env(monkeypatch, tasks=16, nodes=2, procid=11, localid=3)
    assert cluster.detect() == cluster.Job("slurm", "gpu003:62674", 16, 11, (3,))


@pytest.mark.parametrize(("local_size", "devices"), [(1, None), (4, (2,))])
def test_open_mpi(monkeypatch, local_size, devices):
    monkeypatch.setenv("OMPI_MCA_orte_hnp_uri", "1531576320.0;tcp://127.0.0.5,10.0.0.1:34911")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "8")
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "6")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "2")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", str(local_size))
    # Port: job id 1531576320 / 4096 = 373920, mod 4096 = 1184, + 61440.
    assert cluster.detect() == cluster.Job("ompi", "127.0.0.5:62624", 8, 6, devices)


class _MetadataServer(http.server.ThreadingHTTPServer):
    """The GCE metadata server of one TPU VM worker, on 127.0.0.1."""

    def __init__(self, attributes: dict[str, str]):
        self.attributes = attributes
        self.requests: list[tuple[str, str]] = []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                server.requests.append((self.path, self.headers.get("Metadata-Flavor")))
                key = self.path.rsplit("/", 1)[-1]
                body = server.attributes.get(key)
                self.send_response(200 if body is not None else 404)
                self.end_headers()
                self.wfile.write((body or "").encode())

            def log_message(self, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()


@pytest.fixture
def metadata_server(monkeypatch, tpu_vm):
    server = _MetadataServer({})
    monkeypatch.setenv("GCE_METADATA_IP", f"127.0.0.1:{server.server_address[1]}")
    monkeypatch.setattr(requests, "get", requests.api.get)  # this server may be asked
    yield server
    server.shutdown()


def test_gke_tpu_pod(monkeypatch, metadata_server):
    # GKE's TPU webhook sets these; JAX still asks the node's metadata server for
    # a multislice coordinator (an empty tpu-env: one slice).
    monkeypatch.setenv("TPU_SKIP_MDS_QUERY", "true")
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "localhost,worker-1,worker-2,worker-3")
    monkeypatch.setenv("TPU_WORKER_ID", "2")
    metadata_server.attributes["tpu-env"] = ""
    assert cluster.detect() == cluster.Job("gketpu", "localhost:8482", 4, 2, None)


def test_gke_multislice(monkeypatch, tpu_vm):
    monkeypatch.setenv("TPU_SKIP_MDS_QUERY", "true")
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "worker-0,worker-1,worker-2,worker-3")
    monkeypatch.setenv("TPU_WORKER_ID", "1")
    monkeypatch.setenv("MEGASCALE_COORDINATOR_ADDRESS", "localhost:8080")
    monkeypatch.setenv("MEGASCALE_NUM_SLICES", "2")
    monkeypatch.setenv("MEGASCALE_SLICE_ID", "1")
    # Slice 1, worker 1 of 4 per slice.
    assert cluster.detect() == cluster.Job("gketpu", "localhost:8482", 8, 5, None)


def test_gce_tpu_vm_pod_from_the_metadata_server(metadata_server):
    metadata_server.attributes.update(
        {
            "agent-worker-number": "3",
            # The older name:id:ip format; JAX takes the addresses.
            "worker-network-endpoints": ",".join(f"w{i}:{i}:127.0.0.{i + 1}" for i in range(4)),
            "tpu-env": "ACCELERATOR_TYPE: 'v3-32'\n",
        }
    )
    assert cluster.detect() == cluster.Job("gcetpu", "127.0.0.1:8482", 4, 3, None)
    assert metadata_server.requests
    assert {flavor for _, flavor in metadata_server.requests} == {"Google"}


def test_gce_multislice_from_the_metadata_server(metadata_server):
    metadata_server.attributes.update(
        {
            "agent-worker-number": "1",
            "worker-network-endpoints": "localhost,worker-1",
            "tpu-env": "MEGASCALE_COORDINATOR_ADDRESS: '127.0.0.9'\nMEGASCALE_NUM_SLICES: '4'\n"
            "MEGASCALE_SLICE_ID: '2'\n",
        }
    )
    # 2 workers a slice, 4 slices; slice 2, worker 1.
    assert cluster.detect() == cluster.Job("gcetpu", "127.0.0.9:8482", 8, 5, None)


def test_a_tpu_vm_without_a_pod_is_a_job_of_one(metadata_server):
    metadata_server.attributes.update(
        {
            "agent-worker-number": "0",
            "worker-network-endpoints": "localhost",
            "tpu-env": "",
        }
    )
    assert cluster.detect() == cluster.Job("gcetpu", "localhost:8482", 1, 0, None)


def test_flags_override_detection(monkeypatch):
    slurm_env(monkeypatch, tasks=16, nodes=2, procid=11, localid=3)
    got = cluster.detect(coordinator_address="10.1.2.3:1234", num_processes=3, process_id=2)
    assert got == cluster.Job("flags", "10.1.2.3:1234", 3, 2, None)
    with pytest.raises(ConfigError, match="go together"):
        cluster.detect(coordinator_address="10.1.2.3:1234", num_processes=3)


@pytest.mark.parametrize("devices", [None, (3,)])
def test_initialize_passes_the_job_on_and_stops_jax_detecting_again(monkeypatch, devices):
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append(kw))
    job = cluster.Job("slurm", "gpu003:62674", 16, 11, devices)
    cluster.initialize(job, heartbeat_timeout_s=7, shutdown_timeout_s=30)
    assert calls == [
        dict(
            coordinator_address="gpu003:62674",
            num_processes=16,
            process_id=11,
            local_device_ids=None if devices is None else list(devices),
            cluster_detection_method="deactivate",
            heartbeat_timeout_seconds=7,
            shutdown_timeout_seconds=30,
            initialization_timeout=60,
        )
    ]


_PROBE = """
import json
from trainer.command import process
process.setup(cpu_devices=4)
import jax
print(json.dumps({"index": jax.process_index(), "count": jax.process_count(),
                  "devices": jax.device_count(),
                  "cuda_visible": jax.config.read("jax_cuda_visible_devices")}))
"""


@pytest.mark.parametrize(("nodes", "visible"), [(2, ["all", "all"]), (1, ["0", "1"])])
@pytest.mark.slow  # two processes joined as one job
def test_two_slurm_tasks_really_join(nodes, visible):
    """Two real processes under srun's variables (on this machine) start the
    runtime; as one task per node they see all GPUs, as two tasks on one node
    the GPU of their local rank."""
    env = {k: v for k, v in command_env().items() if not k.startswith(_PREFIXES)}
    env.update(
        SLURM_JOB_ID="77",
        SLURM_STEP_NODELIST="localhost",
        SLURM_NTASKS="2",
        SLURM_STEP_NUM_NODES=str(nodes),
        JAX_COORDINATOR_PORT=str(free_port()),
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _PROBE],
            cwd=REPO,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**env, "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i if nodes == 1 else 0)},
        )
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=120) for p in procs]
    for p, (_, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, err[-2000:]
    got = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    assert got == [
        {"index": i, "count": 2, "devices": 8, "cuda_visible": visible[i]} for i in range(2)
    ]
