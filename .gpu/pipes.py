# per-pipeline creation times of a server's startup (driver disk cache off: env from the caller)
import sys, time, logging
from vkengine.options import add_model_args
from server.options import add_serve_args
from server.main import build_worker
import argparse
p = argparse.ArgumentParser(); add_model_args(p); add_serve_args(p)
args = p.parse_args(["--model", sys.argv[1]] + sys.argv[2:])
t = time.perf_counter()
w, b = build_worker(args)
d = b.device
tt = d.pipeline_times
t0 = min(a for _, a, _ in tt)
print(f"build {time.perf_counter()-t:.2f} s; {len(tt)} pipelines; sum of creations {sum(e-a for _, a, e in tt):.2f} s; "
      f"first start to last end {max(e for _, _, e in tt) - t0:.2f} s")
keys = {}
for k, v in d._algorithms.items():
    keys.setdefault(k[0], []).append(k[2])
for name, a, e in sorted(tt, key=lambda x: x[1] - x[2])[:25]:
    print(f"  {e-a:7.2f} s  start {a-t0:6.2f}  {name} {keys.get(name, '')[:2]}")
