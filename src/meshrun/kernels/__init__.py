"""meshrun's own GPU kernels for its GPT, where no library has one: the head loss (Triton) and
the MLP's GELU in cuBLASLt's epilogues."""
