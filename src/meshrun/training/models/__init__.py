"""The models meshrun's trainer brings: its GPT (with a mixture-of-experts variant) and the
pytorch/examples' toy regression model; attention kernel choice and the chunked loss."""

from .gpt import GPT, GPTConfig, gpt
from .toy import Toy

__all__ = ["GPT", "GPTConfig", "Toy", "gpt"]
