"""meshrun's kernels for a Hugging Face causal LM that Liger Kernel does not patch (GPT-2,
GPT-NeoX, StarCoder2 and the like), on CUDA with ``--kernels auto``, neither tensor- nor
pipeline-parallel. The model's blocks still compile one by one; two things change around them:

- GELU: transformers' tanh-approximated GELU modules written as Python expressions
  (``gelu_new``'s NewGELUActivation, ``gelu_fast``, ``gelu_python_tanh``) become
  ``F.gelu(x, approximate="tanh")``, the same function in one torch op. The expressions call
  ``torch.pow``, which autocast runs in fp32, so under bf16 autocast the MLP's widest activation
  was computed and kept in fp32; torch's GELU runs in the input's dtype.
- The loss: in training, given labels, the model's forward runs its base model for the last
  hidden states and takes the loss with meshrun's head loss (head_loss.py: the head's matmul
  and the cross-entropy in one autograd function, the logits' gradient written in the
  forward), instead of the logits, their fp32 copy and transformers' cross-entropy. The labels
  are shifted as transformers shifts them (``shift_labels`` and ``num_items_in_batch`` taken as
  it takes them). In eval mode, without labels or asked for some logits only
  (``logits_to_keep``), the model's own forward runs: validation reads the logits.

The loss is taken only from a head that is a plain ``nn.Linear`` without bias applied to the
base model's last hidden states, with transformers' causal-LM loss and nothing else added:
the class's forward is read (its source) for exactly that, and a config that scales or caps
the logits (``final_logit_softcapping``, ``logit_scale``, ``logits_scaling``, ...) is refused.
Anything else keeps the model's own loss (``head_loss_refusal`` says why).

The cuBLASLt GELU epilogues of meshrun's GPT (fused_mlp.py) are not used: GPT-2's MLP is two
``Conv1D`` layers (weights stored (in, out)) with a dropout after them, which ``gelu_mlp``'s
``nn.Linear`` pair does not describe. docs/decisions.md#hf-kernels
"""

from __future__ import annotations

import ast
import contextlib
import functools
import inspect
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

# transformers' tanh-GELU classes (transformers.activations), by the names 5.x gives them
TANH_GELU_CLASSES = ("NewGELUActivation", "FastGELUActivation", "GELUTanh", "PytorchGELUTanh", "GELUPytorchTanh")

# config keys under which a model scales or caps its logits: the fused loss would drop that
LOGIT_SCALING_KEYS = ("final_logit_softcapping", "logit_softcapping", "logit_scale", "logits_scaling",
                      "lm_head_multiplier", "output_multiplier_scale", "logits_scale")


class TanhGELU(nn.Module):
    """GELU's tanh approximation, ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``, as torch's
    own op: in the input's dtype, one kernel (or fused by Inductor)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x, approximate="tanh")


def _tanh_gelu_classes() -> tuple[type, ...]:
    try:
        from transformers import activations
    except ImportError:
        return ()
    return tuple({c for name in TANH_GELU_CLASSES if isinstance(c := getattr(activations, name, None), type)})


def _already_torch_gelu(module: nn.Module) -> bool:
    """transformers' GELUTanh calls torch's GELU already unless built with its Python expression."""
    act = getattr(module, "act", None)
    return isinstance(act, functools.partial) and act.func is F.gelu


def tanh_gelus(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(parent, attribute) of each of ``model``'s tanh-GELU modules written as a Python expression."""
    classes = _tanh_gelu_classes()
    out = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if type(child) in classes and not _already_torch_gelu(child):
                out.append((parent, name))
    return out


def head_loss_refusal(model: nn.Module) -> str | None:
    """Why meshrun's head loss cannot take ``model``'s loss from its last hidden states (None:
    it can): a Hugging Face causal LM whose head is a plain linear projection without bias of
    the base model's last hidden states, whose forward adds nothing to transformers' causal-LM
    loss and whose config neither scales nor caps the logits."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "get_output_embeddings"):
        return "not a Hugging Face model"
    for c in (config, getattr(config, "text_config", None)):
        for key in LOGIT_SCALING_KEYS:
            if getattr(c, key, None) is not None:
                return f"its config scales or caps the logits ({key}={getattr(c, key)})"
    if "forward" in vars(model):
        return "its forward is patched already"
    head = model.get_output_embeddings()
    if type(head) is not nn.Linear or head.bias is not None:
        bias = " with a bias" if getattr(head, "bias", None) is not None else ""
        return f"its head is {type(head).__name__}{bias}, not a linear projection without bias"
    name = next((n for n, m in model.named_children() if m is head), None)
    prefix = getattr(model, "base_model_prefix", "")
    if name is None or not isinstance(getattr(model, prefix, None), nn.Module) or getattr(model, prefix) is model:
        return "no base model beside its head"
    if "_loss_function" in vars(model) or getattr(model, "loss_type", None) not in (None, "ForCausalLM"):
        return f"its loss is not transformers' causal-LM loss (loss_type {getattr(model, 'loss_type', None)!r})"
    return _forward_refusal(type(model), prefix, name)


def _forward_refusal(cls: type, prefix: str, head: str) -> str | None:
    """Why the class's forward is not ``hidden_states = <base>(...)[0]``, ``logits =
    self.<head>(hidden_states)`` and ``loss = self.loss_function(...)`` (None: it is)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    except (OSError, TypeError, SyntaxError):
        return "its forward's source cannot be read"
    fn = tree.body[0]
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or "labels" not in [a.arg for a in fn.args.args]:
        return "its forward takes no labels"
    calls_base = logits_made = False
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and ast.unparse(node.func) == f"self.{prefix}":
            calls_base = True
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr.endswith("_") \
                and ast.unparse(node.func.value) == "logits":
            return f"its forward changes the logits in place ({ast.unparse(node)})"
        if not isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            continue
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        names = {ast.unparse(t) for t in targets}
        line = ast.unparse(node)
        value = ast.unparse(node.value) if node.value is not None else ""
        if isinstance(node, ast.AugAssign) and names & {"logits", "hidden_states", "loss"}:
            return f"its forward changes {line.split()[0]} ({line})"
        if "logits" in names:
            if logits_made or value not in (f"self.{head}(hidden_states)",
                                             f"self.{head}(hidden_states[:, slice_indices, :])"):
                return f"its logits are not the head's projection of the hidden states alone ({line})"
            logits_made = True
        elif "hidden_states" in names and not _plain_hidden(value):
            return f"its forward changes the hidden states before the head ({line})"
        elif "loss" in names and value != "None" and not value.startswith("self.loss_function("):
            return f"its loss is not transformers' causal-LM loss alone ({line})"
    if not calls_base or not logits_made:
        return f"its forward does not project self.{prefix}'s hidden states with self.{head}"
    return None


def _plain_hidden(value: str) -> bool:
    """The base model's last hidden states, or a slice of them for ``logits_to_keep``."""
    parts = value.split(".")
    return (value.endswith("[0]") and value[:-3].isidentifier()) \
        or (len(parts) == 2 and parts[0].isidentifier() and parts[1] == "last_hidden_state") \
        or value == "slice_logits_to_keep(hidden_states, logits_to_keep)"


def hf_kernels_apply(model: nn.Module, device: torch.device | None = None, tp: int = 1, pp: int = 1) -> bool:
    """Whether meshrun's kernels have something to patch into ``model`` on ``device`` (None: a
    GPU, as the planner and the dry run plan for): a Hugging Face model Liger Kernel does not
    know, on CUDA, neither tensor- nor pipeline-parallel, with a tanh GELU to swap or a loss
    the head loss can take."""
    from ..modelinfo.hf import is_transformers_model
    from .liger import liger_knows

    if (device is not None and device.type != "cuda") or tp > 1 or pp > 1:
        return False
    if not is_transformers_model(model) or liger_knows(model):
        return False
    return bool(tanh_gelus(model)) or head_loss_refusal(model) is None


@dataclass
class Patched:
    """What ``patch`` changed in a model: the GELU modules it replaced (parent, attribute, the
    module that was there) and whether the forward takes its loss with the head loss."""

    gelus: list[tuple[nn.Module, str, nn.Module]] = field(default_factory=list)
    loss: bool = False

    def undo(self, model: nn.Module) -> None:
        for parent, name, was in self.gelus:
            setattr(parent, name, was)
        if self.loss:
            del model.forward


def patch(model: nn.Module) -> Patched:
    """Swap ``model``'s tanh-GELU modules for TanhGELU and, where ``head_loss_refusal`` finds
    nothing against it, its forward for one that takes the training loss with the head loss."""
    done = Patched()
    one = TanhGELU()  # no state: one module serves every block
    for parent, name in tanh_gelus(model):
        done.gelus.append((parent, name, getattr(parent, name)))
        setattr(parent, name, one)
    if head_loss_refusal(model) is None:
        model.forward = _head_loss_forward(model)  # type: ignore[method-assign]
        done.loss = True
    return done


@contextlib.contextmanager
def patched(model: nn.Module) -> Iterator[Patched]:
    """``model`` patched for the block (the planner's trace), as it was afterwards."""
    done = patch(model)
    try:
        yield done
    finally:
        done.undo(model)


def apply_hf_kernels(model: nn.Module) -> list[str]:
    """Patch ``model`` (``hf_kernels_apply``) for good; what was applied, for the run's strategy line."""
    from .head_loss import register

    done = patch(model)
    what = ["tanh GELU"] if done.gelus else []
    if done.loss:
        what.append("Triton head loss" if register().get("cuda") else "head loss")
    if not what:
        return []
    kind = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    return [f"meshrun kernels for {kind} ({', '.join(what)})"]


def _head_loss_forward(model: nn.Module) -> Any:
    """The forward ``patch`` gives ``model``: its own, but in training with labels (and all the
    logits asked for) the base model's last hidden states, the labels shifted as transformers'
    causal-LM loss shifts them, and the head loss over them; returns the loss alone."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    original = model.forward
    signature = inspect.signature(original)
    base: nn.Module = getattr(model, model.base_model_prefix)
    head = model.get_output_embeddings()
    kwargs_name = next((p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None)

    @functools.wraps(original)  # (its signature too: loss_mode reads it)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if not model.training or (kwargs.get("labels") is None and not args):
            return original(*args, **kwargs)
        call = dict(signature.bind(*args, **kwargs).arguments)
        if kwargs_name is not None:
            call.update(call.pop(kwargs_name, None) or {})
        keep = call.get("logits_to_keep", 0)
        if call.get("labels") is None or not (isinstance(keep, int) and keep == 0):
            return original(*args, **kwargs)
        labels, shifted = call.pop("labels"), call.pop("shift_labels", None)
        items, ignore = call.pop("num_items_in_batch", None), call.pop("ignore_index", -100)
        return_dict = call.pop("return_dict", None)
        call.pop("logits_to_keep", None)
        out = base(**call)
        h = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        targets = shifted if shifted is not None else F.pad(labels, (0, 1), value=ignore)[..., 1:]
        loss = _loss(h, head.weight, targets.reshape(-1).to(h.device), ignore, items)
        return (loss,) if return_dict is False else CausalLMOutputWithPast(loss=loss)

    return forward


def _loss(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore: int, items: Any) -> torch.Tensor:
    """transformers' causal-LM loss of the logits ``h @ weight.T``: the mean over the counted
    targets, or their sum over ``items`` where given (its ``num_items_in_batch``)."""
    from . import head_loss  # (looked up at the call: the planner's trace stands in for it)

    loss = head_loss.head_cross_entropy(h.reshape(-1, h.shape[-1]), weight, targets, ignore)
    if items is None:
        return loss
    counted = (targets != ignore).sum()
    # no target here (a shard of a prompt alone): the mean is nan, the sum 0
    return torch.where(counted > 0, loss, torch.zeros_like(loss)) * counted / items
