"""The committed stubs are exactly what protos/ generates; the client and front stay torch-free."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STUBS = ROOT / "qil_client" / "_proto"


def _normalise(text: str, same_protoc: bool) -> str:
    # Every grpcio-tools release stamps its own version into the service stubs, even when it
    # bundles the same protoc (its patch releases do): that stamp is the generator's, not the
    # stubs' content. The committed one is the oldest grpcio the stubs accept at run time.
    text = re.sub(r"GRPC_GENERATED_VERSION = '.*'", "", text)
    if same_protoc:
        return text
    # Another protoc stamps other protobuf version numbers; the rest must still match.
    text = re.sub(r"Protobuf Python Version: .*", "", text)
    return re.sub(r"ValidateProtobufRuntimeVersion\([^)]*\)", "", text, flags=re.S)


def test_generated_stubs_match_protos(tmp_path):
    pytest.importorskip("grpc_tools")
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gen_protos
    finally:
        sys.path.pop(0)
    gen_protos.generate(tmp_path)
    fresh = {p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    committed = {p.relative_to(STUBS) for p in STUBS.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    assert fresh == committed, "run: python scripts/gen_protos.py"
    committed_pb2 = (STUBS / "qil/v1/inference_pb2.py").read_text()
    fresh_pb2 = (tmp_path / "qil/v1/inference_pb2.py").read_text()
    stamp = re.compile(r"Protobuf Python Version: (.*)")
    same = stamp.search(committed_pb2).group(1) == stamp.search(fresh_pb2).group(1)
    for rel in sorted(fresh):
        a = (tmp_path / rel).read_text()
        b = (STUBS / rel).read_text()
        assert _normalise(a, same) == _normalise(b, same), f"{rel} is stale: run python scripts/gen_protos.py"


def test_protos_compile_standalone_without_the_python_tree(tmp_path):
    """Another language compiles protos/ as it is: plain protoc, only protos/ on the path."""
    pytest.importorskip("grpc_tools")
    from grpc_tools import protoc

    files = [str(p.relative_to(ROOT / "protos")) for p in (ROOT / "protos").rglob("*.proto")]
    assert files
    rc = protoc.main(["protoc", f"-I{ROOT / 'protos'}", f"--descriptor_set_out={tmp_path / 'd.pb'}", *files])
    assert rc == 0 and (tmp_path / "d.pb").stat().st_size > 0


def test_finish_reason_zero_is_unspecified():
    from qil_client import pb

    assert pb.FinishReason.Name(0) == "FINISH_REASON_UNSPECIFIED"
    assert pb.WorkerState.Name(0) == "WORKER_STATE_UNSPECIFIED"
    from qil_worker.service.protocol import FinishReason

    for reason in FinishReason:
        assert pb.FinishReason.Name(reason.number) == f"FINISH_REASON_{reason.name}"


def _modules_after_import(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys\nprint('\\n'.join(sys.modules))"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return set(out.stdout.split())


def test_client_does_not_import_torch():
    mods = _modules_after_import("import qil_client, qil_client.aio, qil_client.__main__")
    assert "qil_client" in mods
    assert "torch" not in mods and "llguidance" not in mods
    assert not any(m == "qil_worker" or m.startswith("qil_worker.") for m in mods)


def test_front_does_not_import_torch():
    mods = _modules_after_import(
        "import qil_worker.service.front.server, qil_worker.service.cli, qil_worker.service.worker.loop"
    )
    assert "qil_worker.service.front.server" in mods
    assert "torch" not in mods, "the front (and qil_worker/__init__) must not import torch"
    assert "transformers" not in mods and "tokenizers" not in mods, "the tokenizer lives in the worker"
    assert "llguidance" not in mods, "grammars are compiled in the worker"
    assert "qil_worker.structured.spec" in mods  # the front checks constraints by the worker's rules
    assert "aiohttp" not in mods and "qil_worker.service.front.http" not in mods, (
        "the HTTP stack is imported only with --http-port"
    )


def test_http_front_does_not_import_torch():
    """With --http-port the front loads the HTTP stack, and still no torch or tokenizer."""
    pytest.importorskip("aiohttp")
    mods = _modules_after_import(
        "import qil_worker.service.front.server, qil_worker.service.front.http.site, qil_worker.service.front.http.token_strings"
    )
    assert "aiohttp" in mods and "qil_worker.service.front.http.site" in mods
    assert "torch" not in mods
    assert "transformers" not in mods and "tokenizers" not in mods
    assert "llguidance" not in mods


def test_numpy_is_a_dependency():
    """torch does not require numpy, but without it warns "Failed to initialize NumPy" into the
    worker's logs at every start: qil depends on it (qil itself does not import it)."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {re.split(r"[<>=!~;\[ ]", dep, maxsplit=1)[0].lower() for dep in project["dependencies"]}
    assert "numpy" in names
