"""meshrun render: each spec checked by the platform's own tools where they install
(bash -n for sbatch, SkyPilot's task schema, the Kubernetes and Kubeflow API models), plus
its content: the node command is meshrun's, with the user's arguments as given."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest
import yaml
from helpers import meshrun, meshrun_here, require, script

from meshrun import __version__
from meshrun.render import RenderSpec, render
from meshrun.render.slurm import node_command

TRAIN = ("meshrun", "train", "--out", "/shared/run-$SLURM_JOB_ID", "--steps", "100")


def test_slurm_script_is_valid_bash_with_well_formed_sbatch_lines(tmp_path):
    text = render(RenderSpec("slurm", TRAIN, nodes=4, gpus_per_node=8, partition="gpu", time="02:00:00"))
    path = tmp_path / "job.sbatch"
    path.write_text(text)
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
    lines = text.splitlines()
    assert lines[0] == "#!/bin/bash"
    first_cmd = next(i for i, line in enumerate(lines) if line and not line.startswith("#"))
    sbatch = [line for line in lines if line.startswith("#SBATCH")]
    assert all(re.fullmatch(r"#SBATCH --[a-z-]+=\S+", line) for line in sbatch), sbatch
    assert all(lines.index(line) < first_cmd for line in sbatch)  # sbatch stops reading at the first command
    assert {"#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8",
            "#SBATCH --partition=gpu", "#SBATCH --time=02:00:00"} <= set(sbatch)


@pytest.mark.parametrize("gpus", [8, 1, 0])
def test_slurm_asks_for_no_cpus_unless_given(gpus):
    """No CPU request of the script's own, whatever the GPUs (8 per GPU would be 64 on an 8-GPU
    node, more than some have: such a job never starts); --cpus-per-task is written as given,
    and the script's comment says which rule it followed."""
    sbatch = [line for line in render(RenderSpec("slurm", TRAIN, gpus_per_node=gpus)).splitlines()
              if line.startswith("#SBATCH")]
    assert not [line for line in sbatch if line.startswith(("#SBATCH --cpus", "#SBATCH -c", "#SBATCH --mincpus"))]
    text = render(RenderSpec("slurm", TRAIN, gpus_per_node=gpus))
    assert "# CPUs: none asked for here" in text
    given = render(RenderSpec("slurm", TRAIN, gpus_per_node=gpus, cpus_per_task=12))
    assert [line for line in given.splitlines() if "cpus" in line and line.startswith("#SBATCH")] == \
        ["#SBATCH --cpus-per-task=12"]
    assert "# CPUs: the --cpus-per-task above" in given


def test_slurm_job_options_render_as_sbatch_reads_them(tmp_path):
    """--account, --qos, --mem, --constraint and each --sbatch-arg become #SBATCH lines before
    the script's first command, the last as given (`--sbatch-arg --exclusive`, its value an
    option of its own, included)."""
    path = tmp_path / "job.sbatch"
    res = meshrun("render", "slurm", "--account", "a", "--qos", "q", "--mem", "0", "--constraint", "h100&ib",
                  "--sbatch-arg", "--exclusive", "--sbatch-arg=--mail-type=END", "-o", str(path), "--", *TRAIN)
    assert res.returncode == 0, res.stderr
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
    lines = path.read_text().splitlines()
    first_cmd = next(i for i, line in enumerate(lines) if line and not line.startswith("#"))
    sbatch = lines[:first_cmd]
    for line in ("#SBATCH --account=a", "#SBATCH --qos=q", "#SBATCH --mem=0", "#SBATCH --constraint=h100&ib",
                 "#SBATCH --exclusive", "#SBATCH --mail-type=END"):
        assert sbatch.count(line) == 1, (line, sbatch)
    assert not any(line.startswith("#SBATCH --account") for line in render(RenderSpec("slurm", TRAIN)).splitlines())


def test_slurm_node_command_is_the_argv_as_given(tmp_path):
    """A `$` in the command is the user's text: neither the batch host's bash nor the node's
    expands it (meshrun finds the node's rank and head from Slurm's variables itself)."""
    text = render(RenderSpec("slurm", ("meshrun", "train", "--out", "/runs/$SLURM_NODEID"), nodes=2))
    cmd = node_command(text)
    assert cmd == "exec meshrun train --out '/runs/$SLURM_NODEID'"
    out = subprocess.run(["bash", "-c", cmd.replace("exec meshrun train", "echo")],
                         env={"SLURM_NODEID": "7", "PATH": os.environ["PATH"]}, capture_output=True, text=True)
    assert out.stdout.strip() == "--out /runs/$SLURM_NODEID"


def _skypilot_python() -> str | None:
    py = os.environ.get("MESHRUN_SKYPILOT_PYTHON")
    if py:
        return py
    try:
        import sky  # noqa: F401  (importable here: validate with this Python)

        return sys.executable
    except ImportError:
        return None


def _skypilot_check(texts: list[str], cwd) -> list[str]:
    """Each task YAML as SkyPilot reads it (tests/scripts/validate_skypilot.py), in ``cwd``,
    where a relative workdir is looked for: VALID or INVALID: why, one line per task."""
    py = _skypilot_python()
    if py is None:
        if os.environ.get("MESHRUN_TEST_STRICT") == "1":
            pytest.fail("no SkyPilot to validate against (set MESHRUN_SKYPILOT_PYTHON) but MESHRUN_TEST_STRICT=1")
        pytest.skip("SkyPilot not installed")
    out = subprocess.run([py, script("validate_skypilot.py")], input="---\n".join(texts), capture_output=True,
                         text=True, timeout=120, cwd=cwd)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.splitlines()


SKY_TRAIN = ("meshrun", "train", "--out", "/shared/run1", "--steps", "100")


def test_skypilot_tasks_match_what_skypilot_reads(tmp_path):
    """Each form of task, read by SkyPilot's own schema and Task (tasks of the wrong shape are
    refused by the same check): meshrun train on a volume, uploading nothing; a script with
    its --workdir; an image with its own setup; and by default setup installs this meshrun
    with the framework's extras."""
    (tmp_path / "src").mkdir()
    specs = {
        "volume": RenderSpec("skypilot", SKY_TRAIN, nodes=2, volume="runs:/shared"),
        "workdir": RenderSpec("skypilot", ("train.py", "--epochs", "3"), nodes=2, framework="deepspeed",
                              workdir="src"),
        "image": RenderSpec("skypilot", ("train.py",), nodes=4, gpus_per_node=4, image="ghcr.io/me/img:1",
                            setup="pip install -e .", workdir="src", accelerator="A100"),
        "cpu": RenderSpec("skypilot", SKY_TRAIN, nodes=1, gpus_per_node=0, setup=""),
    }
    texts = {key: render(spec) for key, spec in specs.items()}
    tasks = {key: yaml.safe_load(text) for key, text in texts.items()}
    volume, workdir, image, cpu = tasks["volume"], tasks["workdir"], tasks["image"], tasks["cpu"]
    assert volume["num_nodes"] == 2 and volume["resources"] == {"accelerators": "H100:8", "network_tier": "best"}
    assert "workdir" not in volume and volume["volumes"] == {"/shared": "runs"}
    assert volume["setup"] == f"pip install 'meshrun[torch]=={__version__}'\n"
    assert volume["run"] == shlex.join(SKY_TRAIN) + "\n"
    assert workdir["workdir"] == "src" and "volumes" not in workdir
    assert workdir["setup"] == f"pip install 'meshrun[torch,deepspeed]=={__version__}'\n"
    assert workdir["run"].strip() == "meshrun launch -f deepspeed train.py --epochs 3"
    assert image["resources"]["image_id"] == "docker:ghcr.io/me/img:1" and image["setup"] == "pip install -e .\n"
    assert "setup" not in yaml.safe_load(render(RenderSpec("skypilot", SKY_TRAIN, image="img:1")))  # it holds meshrun
    assert "setup" not in cpu and "accelerators" not in cpu["resources"]
    # the check has teeth: each of these is refused, for the reason given
    bad = [("volume", "num_nodes: 2", "num_nodes: two", "'two' is not of type 'integer'"),
           ("volume", "/shared: runs", "/shared: Runs_1", "Volume name must be a valid DNS-1123 subdomain"),
           ("volume", "/shared: runs", "shared: runs", "File mount destination must be an absolute path"),
           ("volume", "/shared: runs", "/shared/: runs", "Mount paths cannot end with a slash"),
           ("workdir", "workdir: src", "workdir: missing", "Workdir must be a valid directory")]
    broken = []
    for key, old, new, _ in bad:
        assert old in texts[key]
        broken.append(texts[key].replace(old, new))
    results = _skypilot_check([*texts.values(), *broken], tmp_path)
    assert results[:len(texts)] == ["VALID"] * len(texts), results
    for (*_, why), result in zip(bad, results[len(texts):], strict=True):
        assert result.startswith("INVALID: " + why), (why, result)


def test_skypilot_extras_are_meshrun_extras():
    """Every framework's setup installs extras meshrun's package defines, so pip on the node
    finds them (an unknown extra is a warning there, and the framework missing)."""
    from importlib.metadata import metadata

    from packaging.requirements import Requirement

    from meshrun.render.skypilot import EXTRAS, default_setup
    from meshrun.vocab import FRAMEWORKS

    extras = set(metadata("meshrun").get_all("Provides-Extra") or ())
    assert set(EXTRAS) == set(FRAMEWORKS)
    for framework in FRAMEWORKS:
        setup = default_setup(RenderSpec("skypilot", SKY_TRAIN, framework=framework))
        assert setup is not None
        pip, install, requirement = shlex.split(setup)
        req = Requirement(requirement)
        assert (pip, install, req.name, str(req.specifier)) == ("pip", "install", "meshrun", f"=={__version__}")
        assert req.extras and req.extras <= extras, (framework, req.extras)


def _roundtrip(api, doc: dict, model: str) -> None:
    """Deserialize into the API model (required fields and types checked) and serialize
    back: a key the model does not know would be dropped, so the two must be equal."""
    obj = api._ApiClient__deserialize(doc, model)
    assert api.sanitize_for_serialization(obj) == doc


def test_kubernetes_indexed_job_matches_the_api_models():
    require("kubernetes")
    from kubernetes.client import ApiClient

    text = render(RenderSpec("kubernetes", TRAIN, nodes=3, gpus_per_node=4, name="gpt", image="img:1",
                             namespace="ml"))
    service, job = list(yaml.safe_load_all(text))
    api = ApiClient()
    _roundtrip(api, service, "V1Service")
    _roundtrip(api, job, "V1Job")
    assert service["spec"]["clusterIP"] == "None" and job["spec"]["completionMode"] == "Indexed"
    pod = job["spec"]["template"]["spec"]
    assert pod["subdomain"] == service["metadata"]["name"] == "gpt"  # peers resolve as gpt-i.gpt
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    assert env["MASTER_ADDR"]["value"] == "gpt-0.gpt" and env["NNODES"]["value"] == "3"
    assert "job-completion-index" in env["NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert env["MESHRUN_HOSTS"]["value"] == "gpt-0.gpt,gpt-1.gpt,gpt-2.gpt"
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "4"
    with pytest.raises(ValueError):  # the check has teeth: a Job without its template is refused
        api._ApiClient__deserialize({"apiVersion": "batch/v1", "kind": "Job", "spec": {}}, "V1Job")


def test_kubernetes_pytorchjob_matches_kubeflow_models():
    require("kubeflow")
    from kubeflow.training.api_client import ApiClient

    text = render(RenderSpec("kubernetes", TRAIN, nodes=3, gpus_per_node=8, name="gpt", image="img:1",
                             kind="pytorchjob"))
    (job,) = list(yaml.safe_load_all(text))
    _roundtrip(ApiClient(), job, "KubeflowOrgV1PyTorchJob")
    reps = job["spec"]["pytorchReplicaSpecs"]
    assert reps["Master"]["replicas"] == 1 and reps["Worker"]["replicas"] == 2
    assert reps["Master"]["template"]["spec"]["containers"][0]["name"] == "pytorch"


def test_saturn_job_settings():
    text = render(RenderSpec("saturn", ("train.py",), nodes=2, gpus_per_node=4, framework="accelerate",
                             image="saturncloud/saturn-python-pytorch:2024.08.01", setup="pip install meshrun"))
    job = yaml.safe_load(text)
    assert job["type"] == "job"
    spec = job["spec"]
    assert spec["instance_count"] == 2 and spec["command"] == "meshrun launch -f accelerate train.py"
    assert spec["start_script"] == "pip install meshrun"


def test_hostfile_cli(tmp_path):
    out = meshrun("render", "hostfile", "--hosts", "10.0.0.1, 10.0.0.2", "--gpus-per-node", "4",
                  "-o", str(tmp_path / "hostfile"))
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "hostfile").read_text() == "10.0.0.1 slots=4\n10.0.0.2 slots=4\n"


def test_cli_keeps_the_command_after_double_dash(tmp_path):
    out = meshrun("render", "slurm", "--nodes", "2", "-o", str(tmp_path / "job.sbatch"), "--",
                  "meshrun", "train", "--steps", "5", "--out", "runs/a b")
    assert out.returncode == 0, out.stderr
    text = (tmp_path / "job.sbatch").read_text()
    assert node_command(text) == "exec meshrun train --steps 5 --out 'runs/a b'"
    assert os.access(tmp_path / "job.sbatch", os.X_OK)


def _trainer_model(doc: dict, name: str):
    """``doc`` read by Kubeflow Trainer's own API models (pydantic, strict types) and written
    back: a key they do not know or a value of the wrong type does not survive the trip."""
    import kubeflow_trainer_api.models as models

    obj = getattr(models, name).from_dict(doc)
    assert _kept(doc, obj.to_dict()), (doc, obj.to_dict())  # (the models add their defaults: protocol TCP)
    return obj


def _kept(doc, back) -> bool:
    """Whether everything in ``doc`` is in ``back`` as it was."""
    if isinstance(doc, dict):
        return isinstance(back, dict) and all(k in back and _kept(v, back[k]) for k, v in doc.items())
    if isinstance(doc, list):
        return isinstance(back, list) and len(doc) == len(back) and all(_kept(a, b) for a, b in zip(doc, back))
    return doc == back


def test_kubernetes_trainjob_matches_kubeflow_trainers_models():
    """A Kubeflow Trainer v2 TrainJob on the torch-distributed runtime: meshrun's argv as the
    trainer's command, the nodes and GPUs, and shared memory and the volume patched into the
    runtime's node pods."""
    require("kubeflow_trainer_api")
    text = render(RenderSpec("kubernetes", TRAIN, nodes=3, gpus_per_node=8, name="gpt", image="img:1",
                             namespace="ml", kind="trainjob", volume="runs:/shared"))
    (job,) = list(yaml.safe_load_all(text))
    obj = _trainer_model(job, "TrainerV1alpha1TrainJob")
    assert (job["apiVersion"], job["kind"]) == ("trainer.kubeflow.org/v1alpha1", "TrainJob")
    assert obj.spec.runtime_ref.name == "torch-distributed" and obj.spec.trainer.num_nodes == 3
    assert obj.spec.trainer.command == [a.replace("$", "$$") for a in TRAIN]  # Kubernetes' $(VAR) escaped
    assert obj.spec.trainer.image == "img:1"
    assert obj.spec.trainer.resources_per_node.limits["nvidia.com/gpu"].actual_instance == "8"
    pod = obj.spec.runtime_patches[0].training_runtime_spec.template.spec.replicated_jobs[0].template.spec.template.spec
    assert [v.persistent_volume_claim.claim_name for v in pod.volumes if v.persistent_volume_claim] == ["runs"]
    assert {m.mount_path for m in pod.containers[0].volume_mounts} == {"/dev/shm", "/shared"}
    with pytest.raises(ValueError):  # the check has teeth: a TrainJob without its runtime is refused
        _trainer_model({"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob", "spec": {}},
                       "TrainerV1alpha1TrainJob")


def test_kubernetes_jobset_matches_the_api_models_and_its_pods_find_node_0():
    """A JobSet of one Indexed Job: JobSet's models (with Kubernetes' Job inside) read it back;
    each pod's variables, as Kubernetes fills them in (the completion index), resolve in
    meshrun to the same node count, its own rank and node 0 as JobSet names it."""
    require("kubeflow_trainer_api")
    from meshrun.cluster.detect import resolve

    text = render(RenderSpec("kubernetes", TRAIN, nodes=3, gpus_per_node=4, name="gpt", image="img:1",
                             kind="jobset"))
    (doc,) = list(yaml.safe_load_all(text))
    obj = _trainer_model(doc, "JobsetV1alpha2JobSet")
    (rjob,) = obj.spec.replicated_jobs
    assert rjob.replicas == 1 and rjob.template.spec.completions == 3
    assert rjob.template.spec.completion_mode == "Indexed"
    container = doc["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]
    for index in range(3):
        env = {e["name"]: e.get("value", str(index)) for e in container["env"]}  # NODE_RANK: the pod's index
        topo = resolve(env, gpus=4)
        assert (topo.nnodes, topo.node_rank, topo.master_addr) == (3, index, "gpt-node-0-0.gpt"), topo


def test_a_trainjob_pod_resolves_from_what_trainers_torch_runtime_sets():
    """Inside a TrainJob pod Kubeflow Trainer's torch plugin sets PET_* (no MASTER_ADDR): meshrun
    reads the node count, this pod's rank, node 0's address and the port from them."""
    from meshrun.cluster.detect import resolve

    env = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "auto", "PET_NODE_RANK": "1",
           "PET_MASTER_ADDR": "gpt-node-0-0.gpt", "PET_MASTER_PORT": "29400",
           "KUBERNETES_SERVICE_HOST": "10.0.0.1", "JOB_COMPLETION_INDEX": "1"}
    topo = resolve(env, gpus=8)
    assert (topo.platform, topo.nnodes, topo.node_rank, topo.nproc_per_node) == ("kubeflow", 2, 1, 8)
    assert (topo.master_addr, topo.master_port) == ("gpt-node-0-0.gpt", 29400)
    assert topo.source("master_addr") == "env PET_MASTER_ADDR"


@pytest.mark.parametrize("target,goes_with", [("kubernetes", "its pod"), ("skypilot", "its cluster's nodes")])
def test_an_out_on_no_volume_is_warned_about(target, goes_with):
    """Kubernetes and SkyPilot alike: an --out that is on no --volume (a relative one included:
    it lies in the run's directory on the node's disk) is written where the node's disk goes."""
    args = ["render", target, *(["--image", "img:1", "--as", "jobset"] if target == "kubernetes" else [])]
    vol = ["--volume", "runs:/runs"]
    for volume, out, shown in [([], ["--out", "/runs/a"], "/runs/a"), (vol, ["--out=/runsx/a"], "/runsx/a"),
                               (vol, ["--out", "runs/a"], "runs/a"), (vol, ["--out", "/runs/../a"], "/runs/../a")]:
        lost = meshrun_here(*args, *volume, "--", "meshrun", "train", *out)
        assert lost.returncode == 0, lost.stderr
        assert lost.stderr == (f"meshrun render: warning: --out {shown} is on no mounted volume: what the run writes "
                               f"there goes with {goes_with} (hint: --volume "
                               f"{'CLAIM' if target == 'kubernetes' else 'VOLUME'}:PATH with PATH above it)\n")
    for out in ("/runs/a", "/runs", "/runs/./b/"):
        kept = meshrun_here(*args, *vol, "--", "meshrun", "train", "--steps", "3", "--out", out)
        assert kept.returncode == 0 and kept.stderr == "", kept.stderr
    later = meshrun_here(*args, *vol, "--", "meshrun", "train", "--out", "/tmp/a", "--out", "/runs/b")
    assert later.stderr == ""  # argparse takes the last --out


BAD = [
    (["render", "borg", "--", "x.py"], "target='borg': unknown"),
    (["render", "slurm", "--nodes", "0", "--", "x.py"], "--nodes=0: must be in 1..100,000"),
    (["render", "slurm"], "command='': nothing to run"),
    (["render", "kubernetes", "--", "x.py"], "--image is not given: Kubernetes runs containers"),
    (["render", "kubernetes", "--image", "i", "--name", "My_Job", "--", "x.py"],
     "--name='My_Job': is not a Kubernetes name"),
    (["render", "hostfile"], "--hosts='': a hostfile needs"),
    (["render", "slurm", "-f", "mxnet", "--", "x.py"], "--framework='mxnet': unknown"),
    (["render", "slurm", "meshrun", "train", "--steps", "4"], "put the command after --"),
    (["render", "slurm", "--sbatch-arg", "--nodes=3", "--", "x.py"],
     "--sbatch-arg='--nodes=3': sets an option the script renders itself (hint: use meshrun render's --nodes"),
    (["render", "slurm", "--sbatch-arg", "--output=x.log", "--", "x.py"],
     "--sbatch-arg='--output=x.log': sets an option the script renders itself (hint: leave it to meshrun"),
    (["render", "slurm", "--sbatch-arg", "--wrap=a b", "--", "x.py"], "--sbatch-arg='--wrap=a b': is not one sbatch"),
    # sbatch takes any unique prefix of a long option: an abbreviation sets the rendered option too
    (["render", "slurm", "--sbatch-arg", "--gpus-per-n=1", "--", "x.py"],
     "--sbatch-arg='--gpus-per-n=1': abbreviates --gpus-per-node, which the script renders itself (sbatch takes "
     "any unique prefix of an option) (hint: use meshrun render's --gpus-per-node instead)"),
    (["render", "slurm", "--sbatch-arg", "--ntasks-per-n=8", "--", "x.py"], "abbreviates --ntasks-per-node"),
    (["render", "slurm", "--sbatch-arg", "--job-nam=x", "--", "x.py"], "abbreviates --job-name"),
    (["render", "slurm", "--sbatch-arg", "--parti=x", "--", "x.py"], "abbreviates --partition"),
    (["render", "slurm", "--sbatch-arg", "exclusive", "--", "x.py"], "--sbatch-arg='exclusive': is not one sbatch"),
    (["render", "slurm", "--mem", "5GB", "--", "x.py"], "--mem='5GB': is not a Slurm memory size"),
    (["render", "slurm", "--account", "a b", "--", "x.py"], "--account='a b': is not an account (Slurm) or"),
    (["render", "slurm", "--qos", "high;x", "--", "x.py"], "--qos='high;x': is not a Slurm QOS name"),
    (["render", "slurm", "--constraint", "a b", "--", "x.py"], "--constraint='a b': is not a Slurm constraint"),
    (["render", "slurm", "--account", "a\n#SBATCH --x", "--", "x.py"], "contains a control character"),
    (["render", "kubernetes", "--image", "i", "--as", "cronjob", "--", "x.py"],
     "--as='cronjob': is not a Kubernetes kind meshrun renders (hint: one of job, pytorchjob, trainjob, jobset)"),
    (["render", "kubernetes", "--image", "i", "--as", "jobset", "--pytorchjob", "--", "x.py"],
     "--pytorchjob=True: contradicts --as jobset"),
    (["render", "kubernetes", "--image", "i", "--volume", "runs", "--", "x.py"], "--volume='runs': is not CLAIM:PATH"),
    (["render", "kubernetes", "--image", "i", "--volume", "Runs:/x", "--", "x.py"], "--volume='Runs:/x': is not"),
    (["render", "kubernetes", "--image", "i", "--volume", "runs:rel", "--", "x.py"], "--volume='runs:rel': is not"),
    # what the API server would refuse at apply time, refused here
    (["render", "kubernetes", "--image", "i", "--name", "9gpt", "--", "x.py"],
     "--name='9gpt': starts with a digit: the job's Service takes its name"),
    (["render", "kubernetes", "--image", "i", "--volume", "x:/dev//shm/", "--", "x.py"],
     "--volume='x:/dev//shm/': mounts over /dev/shm, which meshrun mounts itself"),
    (["render", "kubernetes", "--image", "i", "--volume", "x:/", "--", "x.py"], "mounts over the container root"),
    (["render", "kubernetes", "--image", "i", "--as", "jobset", "--nodes", "1200", "--name", "a" * 52, "--", "x.py"],
     f"--name='{'a' * 52}': makes the pod host name {'a' * 52}-node-0-1199 (64 characters at 1200 node(s)), over the "
     "63 a DNS label takes (hint: a name of at most 51 characters)"),
    (["render", "slurm", "--volume", "runs:/x", "--", "x.py"],
     "--volume='runs:/x': is for kubernetes and skypilot specs, not slurm (hint: drop it)"),
    (["render", "lsf", "--volume", "runs:/x", "--", "x.py"], "--volume='runs:/x': is for kubernetes and skypilot"),
    (["render", "skypilot", "--volume", "runs", "--", "meshrun", "train"],
     "--volume='runs': is not VOLUME:PATH (a SkyPilot volume's name (sky volumes apply) and an absolute mount path)"),
    (["render", "skypilot", "--volume", "Runs:/x", "--", "meshrun", "train"], "--volume='Runs:/x': is not VOLUME"),
    (["render", "skypilot", "--volume", "runs:/shared/", "--", "meshrun", "train"],
     "--volume='runs:/shared/': ends in '/', which SkyPilot refuses in a mount path (hint: --volume runs:/shared)"),
    (["render", "skypilot", "--volume", "runs:/", "--", "meshrun", "train"],
     "--volume='runs:/': mounts over the node's root directory"),
    (["render", "skypilot", "--volume", "runs:/dev/shm", "--", "meshrun", "train"],
     "--volume='runs:/dev/shm': mounts over /dev/shm, the nodes' shared memory"),
    # a script SkyPilot's run would not find: nothing uploads it without --workdir
    (["render", "skypilot", "--", "train.py", "--epochs", "3"],
     "command='train.py': is a local script, and no --workdir brings it to the nodes (hint: --workdir DIR"),
    (["render", "skypilot", "--workdir", " ", "--", "train.py"], "--workdir=' ': is empty"),
    (["render", "slurm", "--workdir", "src", "--", "x.py"], "--workdir='src': is not used by slurm specs"),
    (["render", "lsf", "--launcher", "srun", "--", "x.py"],
     "--launcher='srun': is not an LSF launcher meshrun renders (hint: blaunch (a plain LSF cluster), jsrun"),
    (["render", "slurm", "--launcher", "jsrun", "--", "x.py"], "--launcher='jsrun': is not used by slurm specs"),
    (["render", "slurm", "--as", "jobset", "--", "x.py"], "--as='jobset': is for Kubernetes specs"),
    (["render", "lsf", "--time", "04:00:00", "--", "x.py"], "--time='04:00:00': is not an LSF run limit"),
    (["render", "lsf", "--qos", "high", "--", "x.py"], "--qos='high': is a Slurm job option, not one for lsf"),
    (["render", "lsf", "--partition", "a,b", "--", "x.py"], "--partition='a,b': is not an LSF queue name"),
    (["render", "lsf", "--image", "img:1", "--", "x.py"], "--image='img:1': an LSF job runs on the nodes' own"),
    (["render", "lsf", "--requeue", "--", "x.py"], "--requeue=True: is for Slurm jobs, not lsf"),
    # every option is used by the target, or refused: never dropped without a word
    (["render", "kubernetes", "--image", "i", "--setup", "pip install x", "--", "x.py"],
     "--setup='pip install x': is not used by kubernetes specs (only slurm, lsf, skypilot, saturn): it would be "
     "dropped"),
    (["render", "lsf", "--cpus-per-task", "4", "--", "x.py"], "--cpus-per-task=4: is not used by lsf specs"),
    (["render", "lsf", "--namespace", "ml", "--", "x.py"], "--namespace='ml': is not used by lsf specs"),
    (["render", "lsf", "--port", "1234", "--", "x.py"], "--port=1234: is not used by lsf specs"),
    # a time limit and the warning before it, checked against each other and against sbatch's bound
    (["render", "slurm", "--requeue", "--time", "1", "--", "x.py"],
     "--time='1': is 60 s, no longer than the 120 s before it that Slurm warns the job to snapshot"),
    (["render", "slurm", "--requeue", "--time", "0-00:05:00", "--signal-before", "300", "--", "x.py"],
     "--time='0-00:05:00': is 300 s, no longer than the 300 s"),
    (["render", "slurm", "--requeue", "--signal-before", "70000", "--", "x.py"],
     "--signal-before=70000: must be between 1 and 65535 seconds"),
    (["render", "skypilot", "--account", "a", "--", "x.py"], "--account='a': is a Slurm or LSF job option"),
]


@pytest.mark.parametrize("args,message", BAD)
def test_bad_input_is_one_line(args, message):
    out = meshrun(*args)
    assert out.returncode == 2
    err = out.stderr.strip().splitlines()
    assert len(err) == 1 and message in err[0], out.stderr
