"""Where a GPU's step time goes (`python benchmark.py --kernels`): the kernels of a few profiled
train steps, read from the profile (`jax.profiler`), summed by kind."""

import collections
import glob
import re
import tempfile

import jax

# A kernel's kind, from its name: the first pattern that it matches. cuDNN's and cuBLAS's kernels
# (convolutions, matrix products), NCCL's, then XLA's fusions, named by what they do
# ("input_convert_reduce_fusion": a reduction, not a convolution).
KINDS = (("convolutions and matrix products", r"xmma|cudnn|cutlass|gemm|nvjet|convolution"),
         ("collectives (NCCL)", r"nccl"),
         ("memset and memcpy", r"memset|memcpy"),
         ("reductions", r"reduce"),
         ("selections", r"select"),
         ("transposes and copies", r"transpose|copy"),
         ("other fusions (elementwise)", r""))
SMALL_NS = 5_000  # a kernel shorter than this is mostly its launch


def kind(name: str) -> str:
  return next(kind for kind, pattern in KINDS if re.search(pattern, name.lower()))


def kernels(profile: jax.profiler.ProfileData, num_steps: int) -> dict:
  """The GPU kernels of `profile` (its devices' streams), a step: how long the GPU ran kernels and
  the span from the first to the last, the kernels by kind, those under `SMALL_NS`, and the
  longest kernels by name."""
  events = [event for plane in profile.planes if plane.name.startswith("/device:GPU")
            for line in plane.lines if line.name.startswith("Stream") for event in line.events]
  if not events:
    raise ValueError("the profile holds no GPU kernels: --kernels profiles a GPU's step")
  by_name, count = collections.Counter(), collections.Counter()
  for event in events:
    by_name[event.name] += event.duration_ns
    count[event.name] += 1
  per_step = lambda x: x / num_steps  # noqa: E731
  kinds = {name: dict(ms=0.0, kernels=0.0) for name, _ in KINDS}
  for name, ns in by_name.items():
    kinds[kind(name)]["ms"] += per_step(ns) / 1e6
    kinds[kind(name)]["kernels"] += per_step(count[name])
  small = [event.duration_ns for event in events if event.duration_ns < SMALL_NS]
  return dict(
      span_ms=per_step(max(e.end_ns for e in events) - min(e.start_ns for e in events)) / 1e6,
      kernel_ms=per_step(sum(by_name.values())) / 1e6, kernels=per_step(len(events)),
      small_kernels=per_step(len(small)), small_ms=per_step(sum(small)) / 1e6,
      kinds={name: v for name, v in kinds.items() if v["kernels"]},
      longest=[dict(name=name, ms=per_step(ns) / 1e6, calls=per_step(count[name]))
               for name, ns in by_name.most_common(10)])


def profile(runner, num_steps: int) -> dict:
  """`kernels` of `num_steps` steps of a `benchmark_steps.Runner` (compiled, warmed up)."""
  with tempfile.TemporaryDirectory() as directory:
    with jax.profiler.trace(directory):
      runner.stream(num_steps, 0)
    path, = glob.glob(f"{directory}/**/*.xplane.pb", recursive=True)
    return kernels(jax.profiler.ProfileData.from_file(path), num_steps)


def report(result: dict) -> str:
  """`kernels`' figures as text: the totals, then a table of the kinds and the longest kernels."""
  busy = 100 * result["kernel_ms"] / result["span_ms"]
  lines = [f"a step: {result['span_ms']:.2f} ms from its first kernel to its last, kernels "
           f"running {result['kernel_ms']:.2f} ms ({busy:.0f}%); {result['kernels']:.0f} "
           f"kernels, {result['small_kernels']:.0f} of them under {SMALL_NS / 1e3:.0f} us "
           f"({result['small_ms']:.2f} ms)", "", "| kernels | ms a step | kernels a step | share |",
           "| --- | ---: | ---: | ---: |"]
  for name, v in sorted(result["kinds"].items(), key=lambda item: -item[1]["ms"]):
    lines.append(f"| {name} | {v['ms']:.2f} | {v['kernels']:.0f} | "
                 f"{100 * v['ms'] / result['kernel_ms']:.0f}% |")
  lines += ["", "longest kernels (ms a step, calls a step):"]
  lines += [f"  {k['ms']:7.3f} {k['calls']:5.1f}  {k['name'][:100]}" for k in result["longest"]]
  return "\n".join(lines)
