"""The files a plan writes: DeepSpeed's ds_config.json (the SkyPilot document's keys, every
"auto" resolved to a number), an accelerate config YAML, and a meshrun train config."""

from __future__ import annotations

from typing import Any

from ..modelinfo.spec import ModelSpec
from ..vocab import GPT_PRESETS, Engine
from .candidate import Candidate, Plan

# What a strategy shards, as the ZeRO stage that shards the same (the paper's stages)
ZERO_STAGE = {"none": 0, "optimizer": 1, "grads": 2, "params": 3}


def zero_stage(c: Candidate) -> int:
    """The ZeRO stage of a candidate; TP x PP runs Megatron's distributed optimizer, ZeRO-1."""
    return 1 if c.strategy.engine is Engine.MEGATRON else ZERO_STAGE[c.strategy.shard]


def zero_section(stage: int, hidden: int, offload_optimizer: bool = False,
                 offload_params: bool = False) -> dict[str, Any]:
    """The SkyPilot document's ``zero_optimization`` block for a stage. DeepSpeed's "auto" values are
    what its HF integration would put there: reduce bucket h², prefetch 0.9·h², persistence
    threshold 10·h."""
    h2 = hidden * hidden
    zero: dict[str, Any] = {"stage": stage}
    if stage in (1, 2):
        zero.update(allgather_partitions=True, allgather_bucket_size=int(5e8), overlap_comm=True,
                    reduce_scatter=True, reduce_bucket_size=int(5e8), contiguous_gradients=True)
    if stage == 3:
        zero.update(overlap_comm=True, contiguous_gradients=True, sub_group_size=int(1e9),
                    reduce_bucket_size=h2, stage3_prefetch_bucket_size=int(0.9 * h2),
                    stage3_param_persistence_threshold=10 * hidden, stage3_max_live_parameters=int(1e9),
                    stage3_max_reuse_distance=int(1e9), stage3_gather_16bit_weights_on_model_save=True)
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return zero


def ds_config(plan: Plan, c: Candidate, lr: float = 3e-4) -> dict[str, Any]:
    """A complete ds_config.json for a candidate: batch sizes solved, the stage's ZeRO block."""
    m, t, s = plan.model, plan.train, c.strategy
    b = c.batch
    cfg: dict[str, Any] = {
        "train_batch_size": b.global_batch if b else None,
        "train_micro_batch_size_per_gpu": b.micro if b else None,
        "gradient_accumulation_steps": b.accum if b else None,
        "bf16": {"enabled": t.dtype == "bf16"},
        "zero_optimization": zero_section(zero_stage(c), m.hidden, s.offload_optimizer, s.offload_params),
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
        "gradient_clipping": 1.0,
        "steps_per_print": 100,
        "wall_clock_breakdown": False,
    }
    if s.ac:
        cfg["activation_checkpointing"] = {"partition_activations": False, "contiguous_memory_optimization": False}
    return cfg


def accelerate_config(plan: Plan, c: Candidate, ds_config_file: str = "ds_config.json") -> dict[str, Any]:
    """accelerate's ClusterConfig keys. num_processes is GLOBAL (all nodes' processes)."""
    cl, s = plan.cluster, c.strategy
    out: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE", "debug": False, "machine_rank": 0,
        "num_machines": cl.nodes, "num_processes": cl.world, "main_training_function": "main",
        "mixed_precision": "bf16" if plan.train.dtype == "bf16" else "no",
        "rdzv_backend": "static", "same_network": True, "use_cpu": False, "gpu_ids": "all",
        "downcast_bf16": "no", "tpu_env": [], "tpu_use_cluster": False, "tpu_use_sudo": False,
    }
    if s.engine is Engine.DEEPSPEED:
        out["distributed_type"] = "DEEPSPEED"
        out["deepspeed_config"] = {"deepspeed_config_file": ds_config_file, "zero3_init_flag": zero_stage(c) == 3}
    elif s.kind.uses_fsdp:
        out["distributed_type"] = "FSDP"
        fsdp: dict[str, Any] = {
            "fsdp_version": 2, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            # Accelerate's FSDP moves the optimizer state to the host only with the parameters
            # (FSDP2's CPUOffloadPolicy, the step on the host): its route to an offloading pick's memory
            "fsdp_reshard_after_forward": not s.keep_gathered, "fsdp_offload_params": s.offload_optimizer,
            "fsdp_activation_checkpointing": s.ac, "fsdp_cpu_ram_efficient_loading": True,
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        }
        if plan.model.block_class:
            fsdp["fsdp_transformer_layer_cls_to_wrap"] = plan.model.block_class
        out["fsdp_config"] = fsdp
        if s.kind.hybrid:
            out["parallelism_config"] = {"parallelism_config_dp_replicate_size": cl.world // s.shard_group,
                                         "parallelism_config_dp_shard_size": s.shard_group}
    else:
        out["distributed_type"] = "MULTI_GPU" if cl.world > 1 else "NO"
    return out


def train_config(plan: Plan, c: Candidate, m: ModelSpec) -> dict[str, Any]:
    """A `meshrun train --config` file for the candidate. Data-parallel strategies keep their
    name; expert and context parallelism run beside DDP and FSDP2 full shard; TP x PP runs
    as FSDP2 full shard over the data-parallel rest. A LoRA plan's adapters as
    `meshrun train --lora` takes them."""
    s, b = c.strategy, c.batch
    out: dict[str, Any] = {}
    if m.name in GPT_PRESETS:
        out["model_size"] = m.name
    if s.ep > 1:
        out.update(strategy=s.kind.name, ep=s.ep)
    elif s.cp > 1:
        out.update(strategy=s.kind.name, cp=s.cp)
    elif s.kind.runs_as is not None:  # TP x PP; each sample of the micro-batch is one pipeline micro-batch
        out.update(strategy=s.kind.runs_as, tp=s.tp, pp=s.pp)
        if s.pp > 1 and b is not None:
            out["pp_microbatches"] = b.micro
    else:
        out["strategy"] = s.name
    out.update(activation_checkpointing="full" if s.ac else "selective" if s.sac else "none",
               seq_len=plan.train.seq_len, precision=plan.train.precision,
               compile="on" if plan.train.compile else "off")
    if b is not None:
        out.update(micro_batch=b.micro, global_batch=b.global_batch)
    a = plan.train.adapters
    if a is not None:  # the LoRA run planned, in meshrun train's option names (--lora-alpha: train's default)
        out.update(lora=a.rank, lora_targets=",".join(a.targets), lora_dropout=a.dropout, quantize=a.quantize)
    return out


def write_all(plan: Plan, out_dir: str) -> list[str]:
    """Write the recommended candidate's files into out_dir, all three or none (meshrun.fsio:
    a full disk leaves the files there unchanged); returns their paths. A float8 plan writes
    meshrun train's file alone: DeepSpeed and Accelerate configs would train it in bf16."""
    import json
    import os

    import yaml

    from ..fsio import write_files

    c = plan.recommended
    if c is None:
        return []
    ds, acc, tr = (os.path.join(out_dir, name) for name in ("ds_config.json", "accelerate.yaml", "train.yaml"))
    files: dict[str, bytes | str] = {} if plan.train.float8 else {
        ds: json.dumps(ds_config(plan, _zero_equivalent(plan, c)), indent=2),
        acc: yaml.safe_dump(accelerate_config(plan, c, ds), sort_keys=False),
    }
    files[tr] = yaml.safe_dump(train_config(plan, c, plan.model), sort_keys=False)
    write_files(files, source="--write")
    return list(files)


def _zero_equivalent(plan: Plan, c: Candidate) -> Candidate:
    """For a torch pick, the DeepSpeed candidate of the same stage (so ds_config.json is the
    DeepSpeed route to the same memory), when the plan has one that fits; else the pick."""
    if c.strategy.engine is Engine.DEEPSPEED:
        return c
    stage = zero_stage(c)
    for x in plan.candidates:
        if x.strategy.engine is Engine.DEEPSPEED and zero_stage(x) == stage and x.strategy.ac == c.strategy.ac \
                and not x.strategy.offload_optimizer and x.batch is not None:
            return x
    return c
