"""JAX data parallelism across processes (the Saturn Cloud document's recipe), one line to initialise.

    meshrun launch -f jax examples/jax_train.py            # 2 CPU processes here
    # on each node of a cluster (one process per node drives its GPUs):
    meshrun launch -f jax examples/jax_train.py

``meshrun.jax_initialize()`` replaces the hand-wired ``jax.distributed.initialize(
coordinator_address=..., num_processes=..., process_id=...)``; on CPU it also selects gloo
for cross-process collectives. The model is a linear regression whose batch is sharded over
a mesh of every device of every process; the gradient all-reduce is implied by jit.
"""

import sys

import meshrun

meshrun.jax_initialize()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

n, me = jax.process_count(), jax.process_index()
mesh = Mesh(np.array(jax.devices()), axis_names=("data",))
data_sharding = NamedSharding(mesh, P("data"))
replicated = NamedSharding(mesh, P())

# A cross-process sanity check first: every process contributes me + 1.
total = float(jnp.sum(multihost_utils.process_allgather(jnp.array([me + 1.0]))))

rng = np.random.default_rng(0)
true_w = rng.normal(size=(8, 1)).astype(np.float32)
per_process = 16
local_x = rng.normal(size=(per_process * n, 8)).astype(np.float32)[me * per_process:(me + 1) * per_process]
local_y = local_x @ true_w


def global_batch(local: np.ndarray) -> jax.Array:
    """Assemble the global batch from each process's slice (no process holds all of it)."""
    shape = (local.shape[0] * n, *local.shape[1:])
    return jax.make_array_from_process_local_data(data_sharding, local, shape)


x, y = global_batch(local_x), global_batch(local_y)
w = jax.device_put(jnp.zeros((8, 1)), replicated)


@jax.jit
def step(w, x, y):
    loss, grad = jax.value_and_grad(lambda w: jnp.mean((x @ w - y) ** 2))(w)
    return w - 0.1 * grad, loss


losses = []
for _ in range(50):
    w, loss = step(w, x, y)
    losses.append(float(loss))
checksum = float(jnp.sum(multihost_utils.process_allgather(w, tiled=True)))
sys.stdout.write(f"JAXTRAIN process={me} count={n} devices={jax.device_count()} sum={total:.0f} "
                 f"first={losses[0]:.4f} last={losses[-1]:.6f} checksum={checksum:.6f}\n")
sys.stdout.flush()
jax.distributed.shutdown()
