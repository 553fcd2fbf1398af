# Ray on the H200 (issue 35 item 5), prepared 2026-12-04. Four back-to-back calls (the machine keeps /tmp while warm, 30 s):
#   runs 1-3 plain (no run_on_gpu.sh: .vk is not there): command "bash .gpu/ray1.sh N", carry [".rayw/pN"]
#   run 4: GPU_CMD="bash .gpu/ray1.sh 4" T_cmd=540 tests/gpu/run_on_gpu.sh cmd, carry [".vk", ".spv"]
#   (p3 with .vk and .spv would be 43 + 37 + 16 MB, over a call's 64 MiB)
set -e
mkdir -p /tmp/keep/rayw
case $1 in
  1) cp .rayw/p1/* /tmp/keep/rayw/ ;;
  2) cp .rayw/p2/* /tmp/keep/rayw/ ;;
  3) cp .rayw/p3/* /tmp/keep/rayw/ ;;
  4) cd /tmp/keep/rayw && cat ray.whl.part* > ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl \
       && echo "$(cat ray.whl.sha256)  ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl" | sha256sum -c - && cd - >/dev/null
     python3 -m pip install -q --no-index --no-deps --target /tmp/site-ray /tmp/keep/rayw/*.whl && python3 -c "import sys; sys.path.insert(0, '/tmp/site-ray'); import ray, ray.serve; print('ray', ray.__version__)"
     export PYTHONPATH=/tmp/site-ray:$PYTHONPATH RAY_USAGE_STATS_ENABLED=0
     f=$(synth_model llama:1b:q4_0)
     timeout 480 python3 bench/ray_scale.py --model $f --replicas 1,2,4 --clients 16 -n 128 --parallel 8 --ctx 2048 \
       --json $OUT/ray-scale.json 2>&1 | grep -v " INFO \|WARNING" | tail -12 ;;
esac
ls /tmp/keep/rayw | wc -l
