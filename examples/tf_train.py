"""TensorFlow MultiWorkerMirroredStrategy with chief-only checkpointing (the Saturn Cloud document).

    meshrun launch -f tensorflow examples/tf_train.py fit /tmp/ckpt     # 2 workers here
    # on every node (or call meshrun.tf_config() and run `python` yourself):
    meshrun launch -f tensorflow examples/tf_train.py fit /shared/ckpt

``meshrun.tf_config()`` returns the TF_CONFIG meshrun set (or builds it from the platform's
variables when started without meshrun) and must run before the strategy is created.

Usage: tf_train.py fit|loop CKPT_DIR
  fit   Keras ``model.fit`` through tf_keras (Keras 2, TF_USE_LEGACY_KERAS=1): Keras 3's fit
        rejects the strategy's PerReplica batches (FIELD-NOTES), tf_keras handles them.
  loop  Keras 3 model with a custom step under ``strategy.run``.

Checks that workers really synchronise: after training, every worker prints a checksum of
its weights, and they must be identical. Only the chief (worker 0) writes the checkpoint
to the shared directory; the others write to a private temp directory (the Saturn Cloud
document's rule).
"""
import os
import sys

import meshrun

MODE, CKPT_ROOT = sys.argv[1], sys.argv[2]
if MODE == "fit":
    os.environ["TF_USE_LEGACY_KERAS"] = "1"  # must precede the first tensorflow import
cfg = meshrun.tf_config()
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

strategy = tf.distribute.MultiWorkerMirroredStrategy()
index = cfg["task"]["index"]
GLOBAL_BATCH = 16

with strategy.scope():
    model = tf.keras.Sequential([tf.keras.Input(shape=(8,)), tf.keras.layers.Dense(16, activation="relu"),
                                 tf.keras.layers.Dense(1)])
    optimizer = tf.keras.optimizers.SGD(learning_rate=0.05)
    if MODE == "fit":
        model.compile(optimizer=optimizer, loss="mse")

rng = np.random.default_rng(0)
x = rng.normal(size=(256, 8)).astype("float32")
y = (x @ rng.normal(size=(8, 1))).astype("float32")
dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH).repeat()
options = tf.data.Options()
options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
dist_data = iter(strategy.experimental_distribute_dataset(dataset.with_options(options)))


@tf.function
def train_step(batch):
    # Keras 3's model.fit with MultiWorkerMirroredStrategy fails on PerReplica inputs
    # (FIELD-NOTES); a custom step under strategy.run is the pattern that works.
    def step(inputs):
        features, labels = inputs
        with tf.GradientTape() as tape:
            pred = model(features, training=True)
            per_example = tf.reduce_mean(tf.square(pred - labels), axis=-1)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    losses = strategy.run(step, args=(batch,))
    return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)


if MODE == "fit":
    history = model.fit(dataset.with_options(options), epochs=3, steps_per_epoch=10, verbose=0)
    first, last = history.history["loss"][0], history.history["loss"][-1]
else:
    first = last = None
    for _ in range(30):
        last = float(train_step(next(dist_data)))
        first = last if first is None else first

checksum = sum(float(np.sum(w)) for w in model.get_weights())
target = os.path.join(CKPT_ROOT, "chief") if index == 0 else os.path.join(CKPT_ROOT, f"tmp-worker-{index}")
os.makedirs(target, exist_ok=True)
model.save_weights(os.path.join(target, "final.weights.h5"))
sys.stdout.write(f"TFTRAIN mode={MODE} index={index} workers={len(cfg['cluster']['worker'])} first={first:.4f} "
                 f"last={last:.4f} checksum={checksum:.6f}\n")
sys.stdout.flush()
