"""Will it fit? Compiles the train step, the eval step and the initial state of a config for a
TPU or GPU topology that need not be here, with the TPU's or the GPU's own compiler, and says
what a device holds, what the step moves and how fast it can be at best.

  python aot.py --config=configs/default.py --topology=v5e:4x4 [--num_slices=2]
      [--config.KEY=VALUE ...] [--json=FILE] [--hlo=FILE]

TPUs need the `tpu` extra (libtpu), NVIDIA GPUs the `cuda12` extra; neither needs the device.
Nothing is read or built: the state and the batches are abstract (shapes, dtypes, shardings),
from the data's description (`sources.describe`). The mesh, shardings, k (rolled, as on
an accelerator) and steps are train.py's own (plan.py, sharding.py, dispatch.py, runs.py). The
figures are the compiler's; they leave out the input pipeline and the host's memory.
"""

import os

# Compile only: JAX's own backend stays the CPU, the GPU plugin does not look for a driver,
# libtpu asks no metadata server for the TPU it is on and lets other processes load it too.
# Set before JAX is imported.
for _key, _value in (("JAX_PLATFORMS", "cpu"), ("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1"),
                     ("TPU_SKIP_MDS_QUERY", "1"), ("TPU_ACCELERATOR_TYPE", "v5litepod-8"),
                     ("TPU_WORKER_HOSTNAMES", "localhost"), ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")):
  os.environ.setdefault(_key, _value)

import collections  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from absl import app, flags  # noqa: E402
from absl.flags import FLAGS  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from {{cookiecutter.project_slug}} import errors, plan, rules  # noqa: E402
from {{cookiecutter.project_slug}}.data import batches, sources  # noqa: E402
from {{cookiecutter.project_slug}}.parallel import chips, sharding, topologies  # noqa: E402
from {{cookiecutter.project_slug}}.training import dispatch, flops, optim  # noqa: E402

COLLECTIVES = ("all-reduce-scatter", "reduce-scatter", "all-gather", "all-reduce", "all-to-all",
               "collective-permute", "collective-broadcast")


class DoesNotFit(Exception):
  """The program needs more memory than a device has; the message says how much of each,
  `figures` what is known without the compiled program."""

  figures: dict = {}


def abstract_batches(config, info, num_devices: int, mesh, pmap: bool):
  """k stacked global batches as train.py feeds them (`input_pipeline`: uint8 pixels), abstract.
  Photos' crops resized on the devices: each device's crops in one row of bytes (`batches.pack`).

  Args:
    config: the run's config, resolved.
    info: the data's DatasetInfo.
    num_devices: the devices.
    mesh: their mesh (the batches split over it: spmd, fsdp).
    pmap: `[devices, k, batch / devices, ...]` instead.
  """
  k, batch = config.run.steps_per_dispatch, config.run.global_batch_size
  shapes = {"label": ((), jnp.int32), "mask": ((), jnp.bool_), "position": ((), jnp.uint32)}
  if info.canvas:
    shapes |= {"box": ((6,), jnp.float32), "offset": ((), jnp.int32)}
  else:
    shapes["image"] = (info.image_shape, info.pixel_dtype)
  row = k * batch // num_devices * math.prod(info.canvas or ()) * info.image_shape[2]
  if pmap:
    batches = {name: jax.ShapeDtypeStruct((num_devices, k, batch // num_devices, *shape), dtype)
               for name, (shape, dtype) in shapes.items()}
    packed = jax.ShapeDtypeStruct((num_devices, 1, 1, row), jnp.uint8)
  else:
    where = sharding.data_sharded(mesh)
    batches = {name: jax.ShapeDtypeStruct((k, batch, *shape), dtype, sharding=where)
               for name, (shape, dtype) in shapes.items()}
    packed = jax.ShapeDtypeStruct((1, num_devices, row), jnp.uint8, sharding=where)
  return batches | ({"image": packed} if info.canvas else {})


def abstract(tree, sharding=None, leading: int | None = None):
  """Shapes and dtypes of a tree.

  Args:
    tree: arrays, or their shapes.
    sharding: each leaf's; None: none.
    leading: the entries of a leading axis added to each; None: none.
  """
  lead = () if leading is None else (leading,)
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct((*lead, *x.shape), x.dtype,
                                                     sharding=sharding), tree)


def bytes_per_device(tree) -> int:
  """The bytes that the abstract arrays of `tree` hold on their most loaded device."""
  held = collections.Counter()
  for x in jax.tree.leaves(tree):
    per_shard = math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
    for device in x.sharding.device_set:
      held[device] += per_shard
  return max(held.values())


def count_collectives(hlo_text: str) -> dict[str, int]:
  """The collectives of a compiled program, by op name: each instruction that is one (its
  asynchronous `-start` half counted once), and each fusion that the compiler named after
  one (the TPU's `all-reduce-scatter`: a reduce-scatter fused with what feeds it). Ops inside
  the k-step loop are counted once: they run k times a call."""
  found = collections.Counter()
  for line in hlo_text.splitlines():
    match = re.match(r"\s*(?:ROOT )?%?[\w.-]+ = .*? ([\w-]+)\(", line)
    if not match:
      continue
    op = match[1].removesuffix("-start")
    if op == "fusion":
      calls = re.search(r"calls=%?([\w-]+)", line)
      op = next((c for c in COLLECTIVES if calls and calls[1].startswith(c)), op)
    if op in COLLECTIVES:
      found[op] += 1
  return dict(sorted(found.items()))


# Bytes an element of each dtype; instructions that launch no kernel (their values are views).
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2,
               "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
NO_KERNEL = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
             "opt-barrier", "add-dependency", "partition-id", "replica-id", "domain"}
SMALL_KERNEL_BYTES = 2**20
_SHAPE = re.compile(r"\b(" + "|".join(DTYPE_BYTES) + r")\[([\d,]*)\]")
_INSTRUCTION = re.compile(r"\s*(?:ROOT )?%?[\w.-]+ = (.*?) ([\w-]+)\((.*)$")


def array_bytes(text: str) -> list[int]:
  """The bytes of each array whose type `text` names ('f32[8,4]{1,0} %x, s32[] %i': 128, 4)."""
  return [DTYPE_BYTES[dtype] * math.prod(int(n) for n in dims.split(",") if n)
          for dtype, dims in _SHAPE.findall(text)]


def kernel_bytes(results: list[int], operands: list[int], fused: list[str]) -> int:
  """What one launch reads and writes: its operands and results once each, except that a fusion
  that slices (a dynamic-slice inside) reads of an operand larger than its results only as much
  as it writes, and one that updates a slice in place (a dynamic-update-slice) reads and writes
  its operands but the buffer it updates, not that buffer.

  Args:
    results: its results' bytes.
    operands: its operands' bytes.
    fused: the instructions fused in it.
  """
  if any(" dynamic-update-slice(" in line for line in fused) and operands:
    return 2 * sum(sorted(operands)[:-1])  # (not the largest: the buffer, aliased by the result)
  if any(" dynamic-slice(" in line for line in fused):
    operands = [min(size, sum(results)) for size in operands]
  return sum(results) + sum(operands)


def count_kernels(hlo_text: str) -> dict[str, int]:
  """The kernels a step launches, read from a compiled program's text: each instruction of the
  k-step loop's body (the whole program when k = 1) that is not a view (`NO_KERNEL`, an async
  op's `-done` half), a fusion or a library call (cuBLAS, cuDNN) counting one; a loop or
  conditional inside the body counts what it runs (an inner loop's body times its trip count).
  `small`: those whose operands and results together hold under 1 MiB, whose time is the
  launch's more than the work's. `bytes`: what they read and write in all (`kernel_bytes`), the
  memory traffic of a step if nothing stays in a cache between kernels. `copies`: the plain
  copies among them (XLA's, where a buffer cannot be updated in place: a layout changed, a
  carried value read after its update), and `copied`, the bytes those read and write."""
  bodies, name, entry = {}, None, None
  for line in hlo_text.splitlines():
    if head := re.match(r"(ENTRY )?%?([\w.-]+) .*\{\s*$", line):
      name, entry = head[2], head[2] if head[1] else entry
      bodies[name] = []
    elif line.startswith("}"):
      name = None
    elif name:
      bodies[name].append(line)

  def trips(line: str) -> int:
    found = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
    return int(found[1]) if found else 1

  loop = next((re.search(r"body=%?([\w.-]+)", line)[1] for line in bodies[entry]
               if " while(" in line and trips(line) > 1), entry)
  found = collections.Counter()

  def walk(computation: str, times: int):
    for line in bodies[computation]:
      if not (match := _INSTRUCTION.match(line)):
        continue
      result, op, rest = match.groups()
      if op in NO_KERNEL or op.endswith("-done"):
        continue
      if op in ("while", "conditional", "call"):
        called = re.findall(r"(?:body|to_apply|true_computation|false_computation)=%?([\w.-]+)",
                            line)
        branches = re.search(r"branch_computations=\{([^}]*)\}", line)
        called += re.findall(r"%?([\w.-]+)", branches[1]) if branches else []
        for name in called:
          walk(name, times * (trips(line) if op == "while" else 1))
        continue
      depth, end = 1, len(rest)  # the operands: up to the parenthesis that closes them
      for i, c in enumerate(rest):
        depth += (c == "(") - (c == ")")
        if depth == 0:
          end = i
          break
      results, operands = array_bytes(result), array_bytes(rest[:end])
      fused = re.search(r"calls=%?([\w.-]+)", line) if op == "fusion" else None
      found["kernels"] += times
      found["small"] += times * (sum(results) + sum(operands) < SMALL_KERNEL_BYTES)
      moved = times * kernel_bytes(results, operands, bodies.get(fused[1], []) if fused else [])
      found["bytes"] += moved
      if op == "copy":
        found["copies"] += times
        found["copied"] += moved

  walk(loop, 1)
  return {key: found[key] for key in ("kernels", "small", "bytes", "copies", "copied")}


def memory(compiled) -> dict[str, int]:
  """Bytes a device holds while the program runs: its arguments, its temporaries, and its
  outputs that do not reuse a donated argument's buffer (`peak`)."""
  stats = compiled.memory_analysis()
  new_outputs = stats.output_size_in_bytes - stats.alias_size_in_bytes
  return dict(argument=stats.argument_size_in_bytes, temp=stats.temp_size_in_bytes,
              peak=stats.argument_size_in_bytes + new_outputs + stats.temp_size_in_bytes)


def compile_timed(lowered_fn, what: str, device_kind: str, memory_bytes: int):
  """Compiles, timed; the compiler's own refusal (a TPU's HBM out-of-memory) reworded.

  Args:
    lowered_fn: the lowered program.
    what: what it is, in the refusal's words.
    device_kind: the devices', in the refusal's words.
    memory_bytes: a device's memory, in the refusal's words.
  Returns:
    (the compiled program, the seconds it took).
  """
  start = time.perf_counter()
  try:
    compiled = lowered_fn().compile()
  except jax.errors.JaxRuntimeError as e:
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    needs = re.search(r"\(([\d.]+[KMGT]?)\) exceeds available HBM \(([\d.]+[KMGT]?)\)", str(e))
    detail = (f"{needs[1]}B of temporaries and arguments, where {device_kind} has {needs[2]}B "
              "for them" if needs else str(e).splitlines()[0][:300])
    raise DoesNotFit(f"the {what} does not fit a device: the compiler says it needs {detail} "
                     f"({memory_bytes / 2**30:.1f} GiB in all)") from None
  return compiled, time.perf_counter() - start


def analyze(config, devices, hlo: str | None = None) -> dict:
  """Compiles a config's train step, eval step and initial state as train.py would build them on
  the devices. Raises rules.ConfigError for a config that train.py would refuse on those
  devices, DoesNotFit for one that the compiler refuses.

  Args:
    config: the config.
    devices: compile-only devices (`topologies.compile_only_devices`).
    hlo: a file to write the compiled train program's text to; None: none.
  Returns:
    The figures (see the README: Will it fit?).
  """
  # JAX's persistent cache cannot load what was compiled for devices that are not here.
  cache = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  try:
    return _analyze(config, devices, hlo)
  finally:
    jax.config.update("jax_enable_compilation_cache", cache)


def _analyze(config, devices, hlo: str | None) -> dict:
  rules.validate_config(config, devices=devices)
  config = plan.resolved(config, devices)
  info = sources.describe(config)
  kind, num_devices = devices[0].device_kind, len(devices)
  device = chips.chip(kind)
  memory_bytes = device.memory_bytes if device else 0
  num_train_steps = batches.num_batches(
      config.num_epochs * info.num_examples["train"], config.run.global_batch_size)
  mesh = sharding.make_mesh(config, devices)
  run_plan = plan.make_plan(config)
  graphdef, state, init = optim.initial_state(run_plan, info, mesh, num_train_steps)
  pmap = config.parallelism == "pmap"
  compiled_steps = dispatch.make(graphdef, run_plan, mesh, unroll=False, info=info,
                                 pmap_devices=devices if pmap else None)
  elements = abstract_batches(config, info, num_devices, mesh, pmap)
  where = None if pmap else sharding.replicated(mesh)
  train_args = (abstract(state, leading=num_devices) if pmap else compiled_steps.put_state(state),
                abstract(run_plan.metrics.train.empty(), where), elements)
  eval_args = (train_args[0], abstract(run_plan.metrics.eval.empty(), where), elements)

  state_bytes = bytes_per_device(state) if not pmap else bytes_per_device(
      abstract(state, sharding.replicated(mesh)))
  figures = dict(
      num_devices=num_devices, device_kind=kind, num_slices=sharding.num_slices(devices),
      num_hosts=len({d.process_index for d in devices}), parallelism=config.parallelism,
      mesh=dict(mesh.shape), steps_per_dispatch=config.run.steps_per_dispatch,
      batch_size=config.run.global_batch_size, memory_bytes=memory_bytes, state_bytes=state_bytes,
      whole_state_bytes=sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(state)))

  def lowered(fn, args):
    return lambda: fn.lower(*args)

  try:
    train, train_s = compile_timed(lowered(compiled_steps.train, train_args), "train step",
                                   kind, memory_bytes)
    evaluate, eval_s = compile_timed(lowered(compiled_steps.eval, eval_args), "eval step", kind,
                                     memory_bytes)
    initial, init_s = compile_timed(init.lower, "initial state", kind, memory_bytes)
  except DoesNotFit as e:
    e.figures = figures
    raise
  train_memory, eval_memory, init_memory = memory(train), memory(evaluate), memory(initial)
  train_text = train.as_text()
  if hlo:
    with open(hlo, "w") as f:
      f.write(train_text)
  speed = flops.Speed(graphdef, abstract(state), info.image_shape, run_plan, devices)
  flops_per_step = speed.flops_per_step
  cost = train.cost_analysis() or {}
  compute_s = flops_per_step / speed.peak if speed.peak else 0.0
  # The compiler's cost analysis counts a loop's body once: its figures are a step's (XLA:GPU's
  # is empty: then the kernels' own bytes, `count_kernels`). Every step reads the state at least
  # once (the parameters, the optimizer's moments).
  kernels = count_kernels(train_text)
  accessed = max(cost.get("bytes accessed", 0.0), kernels["bytes"], state_bytes)
  memory_s = accessed / device.memory_bandwidth if device else 0.0
  lower_bound = max(compute_s, memory_s)
  peak = max(train_memory["peak"], eval_memory["peak"], init_memory["peak"])
  return dict(
      topology=None, **figures, fits=bool(memory_bytes) and peak <= memory_bytes,
      temp_bytes=train_memory["temp"], peak_bytes=peak,
      train=train_memory, eval=eval_memory, init=init_memory,
      collectives=count_collectives(train_text), kernels=kernels, bytes_per_step=accessed,
      flops_per_step=flops_per_step,
      # (XLA:GPU runs a conditional by copying its predicate to the host and waiting.)
      conditionals=len(re.findall(r" conditional\(", train_text)),
      compiler_flops_per_step=cost.get("flops"), compute_seconds_lower_bound=compute_s,
      memory_seconds_lower_bound=memory_s, step_seconds_lower_bound=lower_bound,
      images_per_second_upper_bound=(config.run.global_batch_size / lower_bound
                                     if lower_bound else None),
      compile_seconds=dict(train=train_s, eval=eval_s, init=init_s))


def gb(n: float) -> str:
  return f"{n / 2**30:.3g} GiB" if n >= 2**27 else f"{n / 2**20:.3g} MiB"


def seconds(s: float) -> str:
  return f"{s:.3g} s" if s >= 1 else f"{s * 1e3:.3g} ms" if s >= 1e-3 else f"{s * 1e6:.3g} us"


def describe(r: dict) -> str:
  """The figures as a few lines that a person reads."""
  slices = f" in {r['num_slices']} slices" if r["num_slices"] > 1 else ""
  hosts = f" on {r['num_hosts']} hosts" if r["num_hosts"] > 1 else ""
  headroom = r["memory_bytes"] - r["peak_bytes"]
  spare = round(100 * headroom / r["memory_bytes"]) if r["memory_bytes"] else 0
  fits = (f"fits, {gb(headroom)} ({spare}%) to spare" if r["fits"]
          else f"does NOT fit: {gb(-headroom)} over")
  collectives = ", ".join(f"{n} {op}" for op, n in r["collectives"].items()) or "none"
  bound = r["step_seconds_lower_bound"]
  return "\n".join([
      f"{r['topology']}: {r['num_devices']} x {r['device_kind']}{slices}{hosts}; "
      f"{r['parallelism']} over mesh {r['mesh']}, global batch {r['batch_size']}, "
      f"k = {r['steps_per_dispatch']} steps a call (rolled)",
      f"memory a device: state {gb(r['state_bytes'])} (a whole copy: "
      f"{gb(r['whole_state_bytes'])}), train step temporaries "
      f"{gb(r['temp_bytes'])}, peak {gb(r['peak_bytes'])} of {gb(r['memory_bytes'])}: {fits}",
      f"train step collectives (each once in the program): {collectives}; kernels a step: "
      f"{r['kernels']['kernels']:,}, {r['kernels']['small']:,} of them on under 1 MiB, "
      f"{r['kernels']['copies']:,} copies ({gb(r['kernels']['copied'])})",
      f"FLOPs a step: {r['flops_per_step']:.3g} (the model's matrix products and convolutions)"
      + (f"; the compiler's, a device: {r['compiler_flops_per_step']:.3g}"
         if r["compiler_flops_per_step"] else ""),
      f"at best {seconds(bound)} a step (compute {seconds(r['compute_seconds_lower_bound'])}, "
      f"memory {seconds(r['memory_seconds_lower_bound'])}: {gb(r['bytes_per_step'])} read and "
      f"written, if no kernel's data stayed in a cache), at most "
      f"{r['images_per_second_upper_bound']:,.0f} images/s" if bound else
      "no step-time bound: the device's peak FLOP/s and bandwidth are unknown (chips.CHIPS)",
      "compile: " + ", ".join(f"{what} {s:.2f} s" for what, s in r["compile_seconds"].items()),
  ])


def main(argv):
  del argv
  topology, num_slices, out = FLAGS.topology, FLAGS.num_slices, FLAGS.json
  try:
    devices = topologies.compile_only_devices(topology, num_slices)
    result = analyze(FLAGS.config, devices, FLAGS.hlo)
  except (topologies.TopologyError, rules.ConfigError) as e:
    raise SystemExit(f"error: {e}") from None
  except DoesNotFit as e:
    result, error = dict(topology=topology, **e.figures, fits=False), str(e)
  else:
    result["topology"] = topology + (f" x {num_slices} slices" if num_slices > 1 else "")
    print(describe(result))
    error = None if result["fits"] else (
        f"the {result['parallelism']} step needs {gb(result['peak_bytes'])} a device at its "
        f"peak, and a {result['device_kind']} has {gb(result['memory_bytes'])}")
  if out:
    with open(out, "w") as f:
      json.dump(result, f, indent=2)
  if error:
    raise SystemExit(f"error: {error}; try --config.parallelism=fsdp, a smaller batch "
                     "(--config.batch_size) or more devices.")


if __name__ == "__main__":  # flags defined here: the functions above can be imported
  config_flags.DEFINE_config_file("config", None, "Training config file.", lock_config=True)
  flags.mark_flag_as_required("config")
  flags.DEFINE_string("topology", None, f"The devices to compile for: {topologies.KNOWN}.",
                      required=True)
  flags.DEFINE_integer("num_slices", 1, "TPU slices (multi-slice).")
  flags.DEFINE_string("json", None, "Also write the figures to this JSON file.")
  flags.DEFINE_string("hlo", None, "Also write the compiled train program's text to this file "
                      "(count its kernels, read its fusions).")
  app.run(main, flags_parser=errors.parse_flags)
