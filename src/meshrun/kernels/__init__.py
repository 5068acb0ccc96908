"""meshrun's own GPU kernels for its GPT, where no library has one: the head loss (Triton) and
the MLP's GELU in cuBLASLt's epilogues; Liger Kernel's for the Hugging Face models it knows
(liger.py), and for those it does not, torch's tanh GELU and the head loss (hf.py)."""
