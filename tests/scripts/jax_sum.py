"""Two or more JAX processes: a cross-process sum of (process_index + 1) must be exact."""
import sys

import meshrun

args = meshrun.jax_initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

n, i = jax.process_count(), jax.process_index()
gathered = multihost_utils.process_allgather(jnp.array([i + 1.0]))
total = float(jnp.sum(gathered))
expected = n * (n + 1) / 2
sys.stdout.write(f"JAXSUM process={i} count={n} sum={total:.0f} ok={total == expected} "
                 f"pid_arg={args['process_id']}\n")
sys.stdout.flush()
jax.distributed.shutdown()
