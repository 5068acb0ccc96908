"""Experiment trackers (--log-with): a real W&B run in offline mode and a real MLflow run in a
sqlite store, read back after a run and its resume; the checks made before any rank starts."""

from __future__ import annotations

import glob
import json
import math
import os
import socket
import subprocess
import sys
import time

import pytest
from helpers import clean_env, meshrun, meshrun_here, require


def records(path):
    return [json.loads(line) for line in open(path)]


def numeric(record):
    return {k: v for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


def wandb_records(path):
    """The protobuf records of a W&B run file (.wandb): LevelDB's log format under W&B's
    7-byte header, in 32 KiB blocks of records cut into FULL/FIRST/MIDDLE/LAST pieces."""
    data = open(path, "rb").read()
    assert data[:7] == b":W&B\xe1\xbe\x00", data[:7]
    pos, block, pieces = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        pieces += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, LAST: a whole record
            yield pieces
            pieces = b""


def wandb_history(out):
    """Every history row of every offline W&B run file under OUT, and the run ids of the files."""
    rows, ids, _ = wandb_run_files(out)
    return rows, ids


def wandb_run_files(out):
    """The history rows, run ids and config (as the run's records set it, in order) of every
    offline W&B run file under OUT."""
    from wandb.proto import wandb_internal_pb2

    rows, ids, config = [], set(), {}
    for path in sorted(glob.glob(os.path.join(out, "wandb", "offline-run-*", "run-*.wandb"))):
        ids.add(os.path.basename(path)[len("run-"):-len(".wandb")])
        for data in wandb_records(path):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            kind = record.WhichOneof("record_type")
            if kind == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
            elif kind in ("run", "config"):
                items = record.run.config.update if kind == "run" else record.config.update
                config.update({item.key: json.loads(item.value_json) for item in items if item.key != "_wandb"})
    return rows, ids, config


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(out, *extra, env):
    return meshrun("train", "--model-size", "gpt-tiny", "--nproc", "1", "--log-every", "1", "--save-every", "2",
                   "--out", str(out), *extra, env=env, timeout=600)


def test_wandb_and_mlflow_get_every_metric_of_a_run_and_its_resume_as_one_run(tmp_path):
    require("torch")
    require("wandb")
    require("mlflow")
    out = tmp_path / "run"
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = clean_env(WANDB_MODE="offline", WANDB_PROJECT="meshrun-test", MLFLOW_TRACKING_URI=store,
                    MESHRUN_LOG_WITH="wandb,mlflow,tensorboard", HOME=str(tmp_path))
    first = train(out, "--steps", "2", env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    ids = json.loads((out / "trackers.json").read_text())
    run_id = json.loads((out / "run.json").read_text())["run_id"]
    # an offline W&B run: the closing line says how to upload it, with its directory
    [offline] = glob.glob(str(out / "wandb" / f"offline-run-*-{run_id}"))
    assert f"wandb run {run_id} (offline: wandb sync {offline})" in first.stdout.splitlines()[-1]
    assert ids["wandb"] == {"id": run_id, "project": "meshrun-test"}
    assert ids["mlflow"]["tracking_uri"] == store
    # the resume: the same OUT, more steps (as a requeued job script runs it again)
    second = train(out, "--steps", "4", env=env)
    assert second.returncode == 0, second.stderr[-3000:]
    assert json.loads((out / "trackers.json").read_text()) == ids
    closing = second.stdout.splitlines()[-1]
    assert f"mlflow run {ids['mlflow']['run_id']}" in closing, closing
    # each start wrote a directory of its own: the command uploads both
    assert f"wandb run {run_id} (offline: wandb sync {out}/wandb/offline-run-*-{run_id})" in closing, closing

    logged = {r["step"]: numeric(r) for r in records(out / "metrics.jsonl")}
    assert sorted(logged) == [1, 2, 3, 4]
    assert {"loss", "lr", "grad_norm", "step_time_s", "tokens_per_s", "val_loss", "epoch"} <= set(logged[4])

    # W&B: each start wrote an offline run file under the same run id (wandb sync joins them)
    rows, wandb_ids, config = wandb_run_files(out)
    assert wandb_ids == {run_id}
    # the configuration that ran, not the options as typed (those that differ under given.)
    assert {k: config[k] for k in ("model", "data", "strategy", "warmup", "precision", "seq_len", "micro_batch",
                                   "global_batch", "tokenizer", "vocab_size", "world_size")} == {
        "model": "gpt-tiny", "data": "stdlib", "strategy": "single", "warmup": 0, "precision": "fp32", "seq_len": 256,
        "micro_batch": 8, "global_batch": 8, "tokenizer": "bytes", "vocab_size": 256, "world_size": 1}
    assert config["given.strategy"] == "auto" and config["given.data"] is None and config["given.warmup"] is None
    assert "given.steps" not in config and "model_size" not in config and "sources" not in config
    by_step = {row["step"]: row for row in rows}
    assert sorted(by_step) == [1, 2, 3, 4]
    for step, metrics in logged.items():
        for key, value in metrics.items():
            assert math.isclose(by_step[step][key], value, rel_tol=1e-9), (step, key)

    # MLflow: one run, resumed, with every metric at every step and the resolved config
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=store)
    experiment = client.get_experiment_by_name("meshrun")
    runs = client.search_runs([experiment.experiment_id])
    assert [r.info.run_id for r in runs] == [ids["mlflow"]["run_id"]]
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.data.tags["meshrun.run_id"] == run_id
    params = run.data.params
    assert (params["model"], params["data"], params["strategy"], params["warmup"], params["world_size"]) == \
        ("gpt-tiny", "stdlib", "single", "0", "1")
    assert params["given.strategy"] == "auto" and params["train_tokens"] == str(config["train_tokens"])
    assert run.data.params["steps"] == "2"  # (MLflow keeps a parameter's first value)
    for key in logged[4]:
        history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
        expected = {step: metrics[key] for step, metrics in logged.items() if key in metrics}
        assert sorted(history) == sorted(expected), key
        for step, value in expected.items():
            assert math.isclose(history[step], value, rel_tol=1e-6), (step, key)

    # TensorBoard: the same scalars in OUT/tensorboard
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3, 4]


def test_tensorboard_events_are_written_without_importing_tensorflow(tmp_path):
    """With TensorFlow installed, the rank that writes TensorBoard's events does not import it
    (tensorboard would, for its TF-like API: seconds of every run's start), and the events
    read back with TensorFlow's own tensorboard in this process."""
    require("torch")
    require("tensorflow")
    code = ("import sys\n"
            "from meshrun.training.tracking import TensorBoard\n"
            "board = TensorBoard(sys.argv[1], {'lr': 0.01})\n"
            "board.log({'loss': 1.5, 'lr': 0.01}, 3)\n"
            "board.log({'loss': 1.25}, 4)\n"
            "board.close(True)\n"
            "print('tensorflow' in sys.modules)\n")
    res = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip() == "False", "the tracker imported TensorFlow"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(3, 1.5), (4, 1.25)]
    assert [e.step for e in events.Scalars("lr")] == [3]
    assert "lr: 0.01" in events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()


def test_overwrite_starts_new_tracker_runs(tmp_path):
    require("torch")
    require("mlflow")
    out = tmp_path / "run"
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = clean_env(MLFLOW_TRACKING_URI=store, MLFLOW_EXPERIMENT_NAME="exp", HOME=str(tmp_path))
    assert train(out, "--steps", "1", "--log-with", "mlflow", env=env).returncode == 0
    first = json.loads((out / "trackers.json").read_text())["mlflow"]["run_id"]
    again = train(out, "--steps", "1", "--log-with", "mlflow", "--overwrite", env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    second = json.loads((out / "trackers.json").read_text())["mlflow"]["run_id"]
    assert second != first
    assert glob.glob(str(out / "previous-*" / "trackers.json"))  # the earlier ids set aside with its run
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=store)
    runs = client.search_runs([client.get_experiment_by_name("exp").experiment_id])
    assert {r.info.run_id for r in runs} == {first, second}


@pytest.mark.parametrize("value, says", [
    ("wandb,nosuch", "--log-with='wandb,nosuch': unknown tracker 'nosuch'"),
    ("all,wandb", "--log-with='all,wandb': all stands alone"),
    (",", "--log-with=',': names no tracker"),
])
def test_a_bad_tracker_list_is_one_line(value, says):
    out = meshrun("train", "--model-size", "gpt-tiny", "--steps", "1", "--log-with", value)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == [f"meshrun: error: {says} (hint: "
                                               + out.stderr.split("(hint: ", 1)[1].strip()]


def test_tensorboard_named_without_out_is_refused():
    out = meshrun("train", "--model-size", "gpt-tiny", "--steps", "1", env=clean_env(MESHRUN_LOG_WITH="tensorboard"))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "--log-with (from env MESHRUN_LOG_WITH)='tensorboard': TensorBoard's events are written into --out" \
        in out.stderr


def test_an_unreachable_mlflow_server_is_one_line_before_any_rank_starts(tmp_path):
    require("torch")
    require("mlflow")
    url = f"http://127.0.0.1:{closed_port()}"
    out = train(tmp_path / "run", "--steps", "1", "--log-with", "mlflow",
                env=clean_env(MLFLOW_TRACKING_URI=url, HOME=str(tmp_path)))
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == [
        f"meshrun: error: env MLFLOW_TRACKING_URI={url!r}: the server does not answer (Connection refused) "
        "(hint: start the tracking server, or unset it for a local store)"]
    assert not (tmp_path / "run" / "logs").exists()  # no rank started


def test_wandb_online_without_a_key_or_a_server_is_one_line(tmp_path):
    require("torch")
    require("wandb")
    env = clean_env(HOME=str(tmp_path), WANDB_MODE="online")
    no_key = train(tmp_path / "a", "--steps", "1", "--log-with", "wandb", env=env)
    assert no_key.returncode == 2 and "Traceback" not in no_key.stderr
    assert no_key.stderr.strip().splitlines()[-1].startswith("meshrun: error: --log-with wandb: no W&B API key")
    url = f"http://127.0.0.1:{closed_port()}"
    down = train(tmp_path / "b", "--steps", "1", "--log-with", "wandb",
                 env={**env, "WANDB_API_KEY": "k" * 40, "WANDB_BASE_URL": url})
    assert down.returncode == 2 and "Traceback" not in down.stderr
    assert down.stderr.strip().splitlines() == [
        f"meshrun: error: env WANDB_BASE_URL={url!r}: the server does not answer (Connection refused) "
        "(hint: WANDB_MODE=offline to log now and sync later (wandb sync))"]


def test_a_tracker_that_fails_mid_run_is_dropped_and_the_others_go_on(capsys):
    from meshrun.training import tracking

    class Logged:
        name = "kept"

        def __init__(self):
            self.rows = []

        def log(self, metrics, step):
            self.rows.append((step, dict(metrics)))

    class Failing:
        name = "mlflow"

        def log(self, metrics, step):
            raise ConnectionError("server went away\nsecond line")

    kept, failing = Logged(), Failing()
    trackers = [failing, kept]
    tracking.log(trackers, {"step": 7, "loss": 2.5, "mfu": None, "lr": 1e-3})
    tracking.log(trackers, {"step": 8, "loss": 2.4})
    assert trackers == [kept]
    assert kept.rows == [(7, {"loss": 2.5, "lr": 1e-3}), (8, {"loss": 2.4})]
    assert capsys.readouterr().err == ("meshrun train: mlflow stopped logging at step 7: server went away; "
                                       "metrics.jsonl keeps every record\n")


def test_a_long_message_from_a_tracker_is_cut_whole_never_mid_string(capsys):
    """A client library's message longer than the line allows ends after a whole word, before any
    quote or bracket it would leave open: a host is shown whole or not at all."""
    from meshrun.errors import first_line
    from meshrun.training import tracking

    said = ("API request to http://127.0.0.1:5000/api/2.0/mlflow/runs/create failed with exception "
            "HTTPConnectionPool(host='127.0.0.1', port=5000): Max retries exceeded with url: /api/2.0/mlflow/runs/"
            "create (Caused by ReadTimeoutError(\"HTTPConnectionPool(host='127.0.0.1', port=5000): Read timed out. "
            "(read timeout=120)\"))\nsecond line")

    class Failing:
        name = "mlflow"

        def log(self, metrics, step):
            raise ConnectionError(said)

    tracking.log([Failing()], {"step": 3, "loss": 1.0})
    line = capsys.readouterr().err
    assert line == ("meshrun train: mlflow stopped logging at step 3: API request to http://127.0.0.1:5000/api/2.0/"
                    "mlflow/runs/create failed with exception HTTPConnectionPool(host='127.0.0.1', port=5000): Max "
                    "retries exceeded with url: /api/2.0/mlflow/runs/create …; metrics.jsonl keeps every record\n")
    for limit in range(20, 330, 7):
        cut = first_line(said, limit)
        if cut == said.splitlines()[0]:
            continue
        assert len(cut) <= limit + 2 and cut.endswith(" …"), (limit, cut)
        assert cut.count("(") == cut.count(")") and cut.count("'") % 2 == 0 and '"' not in cut, (limit, cut)
    assert first_line("it doesn't fit in twenty", 20) == "it doesn't fit in …"


def test_a_tracker_not_installed_is_one_line_with_its_extra(tmp_path):
    # Python's own way to make a module absent: None in sys.modules (find_spec then finds nothing)
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['wandb'] = None\n")
    env = clean_env(PYTHONPATH=str(tmp_path))
    out = meshrun("train", "--model-size", "gpt-tiny", "--steps", "1", "--log-with", "mlflow,wandb", env=env)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == [
        "meshrun: error: --log-with='mlflow,wandb': wandb is not installed here "
        "(hint: pip install 'meshrun[wandb]', or drop wandb)"]
    # the default (tensorboard) and "all" take what is installed, without a word
    listed = meshrun("train", "--model-size", "gpt-tiny", "--steps", "1", "--log-with", "all", "--dry-run", env=env)
    assert listed.returncode == 0, listed.stderr[-2000:]


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"mlflow": "run-1"}'])
def test_a_damaged_trackers_json_is_refused_before_any_rank_starts(text, tmp_path, capsys):
    """Read as empty, a damaged OUT/trackers.json would start a second tracker run and split the
    run's curves: refused in one line that says to delete it."""
    require("mlflow")
    from meshrun.cli import main

    out = tmp_path / "run"
    out.mkdir()
    (out / "trackers.json").write_text(text)
    env = clean_env(MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path / 'mlflow.db'}", HOME=str(tmp_path))
    code = main(["train", "--model-size", "gpt-tiny", "--nproc", "1", "--steps", "1", "--out", str(out),
                 "--log-with", "mlflow"], env)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"meshrun: error: {out / 'trackers.json'}: damaged, not the tracker run ids meshrun "
                             "writes") and "(hint: delete it, and the resumed run starts new tracker runs" in err[0]
    assert not (out / "logs").exists()


def test_a_resume_whose_mlflow_run_left_the_store_says_what_to_do(tmp_path, monkeypatch):
    """The store was wiped (or moved) since the run began: the resume says which run is missing
    and that deleting OUT/trackers.json starts a new one."""
    require("mlflow")
    from mlflow.tracking import MlflowClient

    from meshrun.errors import MeshrunError
    from meshrun.training.tracking import start

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'first.db'}")
    out = tmp_path / "run"
    out.mkdir()
    first = start(("mlflow",), str(out), {"lr": 1e-3}, env={})
    first[0].close(finished=True)
    run_id = json.loads((out / "trackers.json").read_text())["mlflow"]["run_id"]
    assert MlflowClient().get_run(run_id).info.status == "FINISHED"
    # the store wiped: a fresh one at the address trackers.json names (an sqlite file removed
    # under MLflow's cached connection would not read as wiped)
    wiped = f"sqlite:///{tmp_path / 'wiped.db'}"
    (out / "trackers.json").write_text(json.dumps({"mlflow": {"run_id": run_id, "tracking_uri": wiped}}))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", wiped)
    with pytest.raises(MeshrunError) as raised:
        start(("mlflow",), str(out), {"lr": 1e-3}, env={})
    line = str(raised.value)
    assert f"--log-with mlflow: the run {run_id} that {out / 'trackers.json'} continues is not in the store" in line
    assert f"(hint: {out / 'trackers.json'}: delete it, and the resumed run starts new tracker runs" in line


@pytest.mark.parametrize("reply", [None, b"not http at all\r\n\r\n"], ids=["silent", "not-http"])
def test_a_server_that_accepts_and_never_answers_is_one_line_within_the_bound(tmp_path, reply):
    """A listener that accepts the connection and then says nothing (or no HTTP) is found before
    any rank starts, within trackers.CONNECT_TIMEOUT_S, and OUT is not created."""
    require("mlflow")
    import threading

    from meshrun.config.trackers import CONNECT_TIMEOUT_S

    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def answer():  # accepts each connection; says nothing, or a line that is not HTTP
        server.settimeout(0.2)
        held = []
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            held.append(conn)
            if reply:
                conn.sendall(reply)
        for conn in held:
            conn.close()

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.getsockname()[1]}"
    try:
        start = time.monotonic()
        out = meshrun_here("train", "--model-size", "gpt-tiny", "--steps", "1", "--log-with", "mlflow",
                           "--out", str(tmp_path / "run"), env=clean_env(MLFLOW_TRACKING_URI=url, HOME=str(tmp_path)))
        took = time.monotonic() - start
    finally:
        stop.set()
        thread.join(timeout=5)
        server.close()
    problem = ("the server accepts connections but sends no answer within 5 s" if reply is None
               else "the server does not answer in HTTP (BadStatusLine)")
    assert (out.returncode, out.stderr.strip().splitlines()) == (2, [
        f"meshrun: error: env MLFLOW_TRACKING_URI={url!r}: {problem} "
        "(hint: start the tracking server, or unset it for a local store)"])
    assert took < CONNECT_TIMEOUT_S + 3
    assert not (tmp_path / "run").exists()
