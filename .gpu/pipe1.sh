f=$(synth_model llama:1b:q4_0)
echo "== threads 1"
__GL_SHADER_DISK_CACHE=0 VKENGINE_PIPELINE_CACHE=off VKENGINE_PIPELINE_THREADS=1 timeout 120 python3 .gpu/pipes.py $f 2>&1 | grep -v INFO | tail -28
echo "== threads 16, coopmat2 off (mul_mc2 and attention_mc2)"
__GL_SHADER_DISK_CACHE=0 VKENGINE_PIPELINE_CACHE=off VKENGINE_COOPMAT2=0 VKENGINE_ATTN_MC2=0 timeout 120 python3 .gpu/pipes.py $f 2>&1 | grep -v INFO | tail -12
f8=$(synth_model llama:8b:q4_0)
echo "== 8B engine init profile (warm page cache)"
cat /tmp/vkengine-bench-models/llama-8b-q4_0.gguf > /dev/null
timeout 60 python3 - $f8 <<'PY' 2>&1 | head -40
import cProfile, pstats, sys, time
from vkengine.device import Device
from vkengine.engine import Engine, EngineConfig
from vkengine.model import load_model
m = load_model(sys.argv[1]); d = Device()
t = time.perf_counter(); pr = cProfile.Profile(); pr.enable()
e = Engine(m, d, EngineConfig(n_slots=4, n_ctx=4096, max_batch=2048, max_out=4))
pr.disable(); print("engine init", time.perf_counter() - t)
pstats.Stats(pr).sort_stats("tottime").print_stats(12)
PY
build_llama > $OUT/llb.txt 2>&1
echo "== cold start 8B warm (weights streamed)"
timeout 120 python3 bench/cold_start.py --model $f8 --llama-server /tmp/llb/bin/llama-server --runs warm \
  --json $OUT/cold-8b-warm.json 2>&1 | tail -4
