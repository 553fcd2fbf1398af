#!/usr/bin/env bash
# Run on the GPU machine (NVIDIA H200, no package registry) through the device
# tool, from the repository root:
#
#   here:   tests/gpu/prepare.sh            # fills .vk/ and .spv/ (ignored by git)
#   there:  tests/gpu/run_on_gpu.sh [tests] [llama] [bench] [serve-bench]
#           (carry: .vk .spv; results under $OUT)
#
# Stages:
#   tests   kernel + model tests through Vulkan on the GPU (junit XML + log)
#   validation  tests/test_vulkan_validation.py under Debian 13's Khronos layer (sync validation)
#   llama   build llama.cpp 11434 with Vulkan (Debian 13 glslc: int-dot and
#           cooperative-matrix shaders on) unless .vk/llama-vulkan.tar.xz has it
#   profile GPU time per op (vkengine bench --profile $PROFILE_ARGS) on PROFILE_MODELS
#   synth   write the BENCH_QWEN models (arch:shape:quant ...) before the bench stage
#   bench   bench/bench.py: ours vs llama-bench on synthetic models (BENCH_MODELS=none: only BENCH_QWEN;
#           BENCH_DEPTHS=0,4096,16384: rows at those depths, llama-bench -d beside them;
#           BENCH_KV=q8_0: both engines with a q8_0 K and V cache)
#   parity  parity run against llama-server's Vulkan build on synthetic llama/qwen35/qwen35moe
#   serve-bench  bench/serve.py: C = 1, 4, 16 streaming clients, ours vs llama-server
#           (SERVE_TEMP=0.8: sampled replies instead of greedy ones)
#   serve-long  bench/serve.py's long prompts: one client with SERVE_LONG-token prompts, and 4 streams
#           beside 4 newcomers with SERVE_MIXED_IDS-token prompts (SERVE_ARGS: our server's extra flags)
#   cmd     run $GPU_CMD (e.g. python3 bench/mv_probe.py --out $OUT/mv-probe.json)
#   qwen35  the hybrid models' tests, and tests/gpu/hf_oracle_qwen35.py (transformers as oracle)
#   mtp     MTP speculative decoding in the server (issue 34): MTP_MODELS (arch:shape:quant, written with
#           synth --mtp-accept: drafts always right) through bench/serve.py, serial vs serial-mtp at C = 1
#           and batch vs batch-mtp at C = 4, --draft MTP_DRAFT (default 2)
#   split   a model split across devices by layers (issue 36): tests/test_split.py on this machine's devices,
#           then SPLIT_MODEL (default llama:8b:q4_0) whole vs split over SPLIT_DEVICES (default 0,1 where
#           there are two GPUs, else 0,0: two Vulkan devices on the one GPU): bench/bench.py pp512/tg128 and
#           batched decode of 4/16 beside llama-bench (-sm none, then -sm layer), the serve bench at C = 4 and 16 (ours whole,
#           ours split, llama-server -sm layer); SPLIT_CAP_MIB (VKENGINE_MEMORY_MIB): each device's memory
#           capped, so that a model needs the split (SPLIT_BIG_MODEL, default qwen35moe:35B-A3B:q4_0)
#   moe     issue 34's targets: MOE_MODEL (default qwen35moe:35B-A3B:q4_0, with the always-accepted MTP head)
#           pp512 / pp2048 / tg128 and 4 / 16 sequences against llama-bench (run before and after ours), each
#           step of an MTP turn (bench --mtp, 2 and 3 drafts; their op profile), the server's MTP at C = 1 (3 drafts)
#           and 4 (2)
#   cold    issue 35's cold start: COLD_MODELS (default llama:1b:q4_0 llama:8b:q4_0) fresh against llama-server,
#           COLD_REPEAT (3) runs each (bench/cold_start.py)
# The device tool carries at most 64 MiB (the tracked tree, .vk and .spv together): with llama.cpp's
# prebuilt Vulkan binaries in .vk (llama-vulkan.tar.xz.part*), move .vk/llama.cpp.tar.gz (the source, for
# build_llama's fallback) and .vk/trixie (glslc for that build; the validation stage's layers) aside for
# the stages that do not need them.
# Everything the GPU machine lacks travels in .vk/: the Vulkan loader and the
# GL vendor-neutral libraries that NVIDIA's Vulkan ICD (libGLX_nvidia) needs, libfmt,
# the patched kp wheel for its Python 3.12, gguf, a tokenizer-only GGUF, the
# trimmed llama.cpp source and Debian 13 shader-compiler packages.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/vkengine-gpu-out}
export OUT
mkdir -p "$OUT"
stages=${*:-tests}

for f in .vk/*.deb; do dpkg -x "$f" /; done
ldconfig
python3 -m pip install -q --no-index --no-deps --target /tmp/site .vk/*.whl >/dev/null 2>&1 || {
  echo "wheel install failed"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 VKENGINE_SPIRV_CACHE=$PWD/.spv
# the checkout runs from PYTHONPATH, not installed: its entry points (`vkengine serve`) declared as pip would
mkdir -p /tmp/site/vkengine-0.dev0.dist-info
printf 'Metadata-Version: 2.1\nName: vkengine\nVersion: 0.dev0\n' > /tmp/site/vkengine-0.dev0.dist-info/METADATA
python3 - <<'PY' > /tmp/site/vkengine-0.dev0.dist-info/entry_points.txt
import tomllib
eps = tomllib.load(open("pyproject.toml", "rb"))["project"].get("entry-points", {})
for group, items in eps.items():
    print(f"[{group}]")
    print("\n".join(f"{k} = {v}" for k, v in items.items()))
PY
export VKENGINE_TOKENIZER_GGUF=$PWD/.vk/smollm2-tokenizer.gguf
# a llama.cpp "tree" holding only what the tests read from its models/ (parity.llamacpp.source_tree)
if [ -f .vk/ggml-vocab-phi-3.gguf ]; then
  mkdir -p /tmp/llsrc/models && cp .vk/ggml-vocab-phi-3.gguf /tmp/llsrc/models/ && export VKENGINE_LLAMA_SRC=/tmp/llsrc
fi
if ! python3 -c 'import kp; assert kp.list_devices_info()' >/dev/null 2>&1; then
  export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
fi
python3 -m vkengine.cli devices | tee "$OUT/devices.txt"
# The device has no glslc: a .spv/ built before any shader source changed (every variant's key hashes all the
# sources) fails each engine start. Say so at once, before the stages spend the call.
python3 - <<'PY' || exit 1
import sys
from vkengine import spirv
from shaders.variants import VARIANTS
miss = [n for n in VARIANTS if not spirv.cached_path(n).exists()]
if miss:
    sys.exit(f"{len(miss)} of {len(VARIANTS)} shader variants are not in {spirv.default_cache_dir()} "
             f"(e.g. {miss[0]}): the cache is older than the shader sources; rebuild it here with "
             "`rm -rf .spv && VKENGINE_SPIRV_CACHE=$PWD/.spv vkengine build-shaders` and carry it again")
PY

build_llama() {
  if [ -x /tmp/llb/bin/llama-bench ]; then return 0; fi
  if ls .vk/llama-vulkan.tar.xz.part* >/dev/null 2>&1; then
    mkdir -p /tmp/llb/bin && cat .vk/llama-vulkan.tar.xz.part* | tar xJf - -C /tmp/llb/bin && return 0
  fi
  local t0=$SECONDS
  mkdir -p /opt/trixie && for f in .vk/trixie/*.deb; do dpkg -x "$f" /opt/trixie; done
  tar xzf .vk/llama.cpp.tar.gz -C /tmp
  export LD_LIBRARY_PATH=/opt/trixie/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
  cmake -S /tmp/llama.cpp -B /tmp/llb -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_VULKAN=ON -DGGML_NATIVE=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF \
    -DVulkan_GLSLC_EXECUTABLE=/opt/trixie/usr/bin/glslc -DVulkan_INCLUDE_DIR=/opt/trixie/usr/include \
    -DVulkan_LIBRARY=/usr/lib/x86_64-linux-gnu/libvulkan.so.1 \
    -DSPIRV-Headers_DIR=/opt/trixie/usr/share/cmake/SPIRV-Headers > "$OUT/llama-cmake.log" 2>&1 \
    || { tail -30 "$OUT/llama-cmake.log"; return 1; }
  cmake --build /tmp/llb --target llama-bench llama-server -j "$(nproc)" > "$OUT/llama-build.log" 2>&1 \
    || { tail -30 "$OUT/llama-build.log"; return 1; }
  strip /tmp/llb/bin/llama-bench /tmp/llb/bin/llama-server
  # parts of at most 15 MB come back through $OUT; prepare.sh keeps them in .vk/
  tar cJf - -C /tmp/llb/bin llama-bench llama-server | split -b 15m -d - "$OUT/llama-vulkan.tar.xz.part"
  echo "llama.cpp Vulkan build: $((SECONDS - t0)) s"
}

# synth_model arch:shape:quant[:accept] -> path of that synthetic GGUF (written once; accept: synth
# --mtp-accept, a model whose MTP drafts are always right)
synth_model() {
  local arch=${1%%:*} rest=${1#*:}; local shape=${rest%%:*} q=${rest#*:}; local extra="" tag=""
  case $q in *:accept) q=${q%:accept}; extra=--mtp-accept; tag=-mtp-accept ;; esac
  local f=/tmp/vkengine-bench-models/$arch-$shape$tag-$q.gguf
  [ -f "$f" ] || python3 -m vkengine.cli synth --arch "$arch" --shape "$shape" --quant "$q" $extra \
    --out /tmp/vkengine-bench-models --name "$arch-$shape$tag" --formats gguf \
    --tokenizer-from "$VKENGINE_TOKENIZER_GGUF" >/dev/null || return 1
  echo "$f"
}

run_stage() {
  local s=$1
  case $s in
    tests)
      # (the llama-server agreement tests take the Vulkan build: the conftest's own would be built from source)
      [ -x /tmp/llb/bin/llama-server ] && export VKENGINE_LLAMA_SERVER=/tmp/llb/bin/llama-server
      python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_models.py tests/test_models_kv_q8.py \
        tests/test_worker.py -k "not smollm" \
        --junitxml="$OUT/gpu-tests.xml" 2>&1 | tee "$OUT/gpu-tests.log" | tail -15
      ;;
    llama)
      build_llama
      ;;
    validation)
      # the CI's validation-layer run (tests/test_vulkan_validation.py) on the GPU, with Debian 13's
      # layer (1.4.309; this machine's glibc takes it) unpacked from .vk/trixie
      mkdir -p /opt/vvl && dpkg -x .vk/trixie/vulkan-validationlayers_*.deb /opt/vvl
      VKENGINE_VALIDATION_LAYER_PATH=/opt/vvl/usr/share/vulkan/explicit_layer.d \
      LD_LIBRARY_PATH=/opt/vvl/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-} \
        python3 -m pytest -q -p no:cacheprovider tests/test_vulkan_validation.py -rA \
        --junitxml="$OUT/gpu-validation.xml" 2>&1 | tee "$OUT/gpu-validation.log" | tail -15
      ;;
    profile)
      # GPU time per op of a decode and a prefill step on each PROFILE_MODELS model
      for spec in ${PROFILE_MODELS:-1b:q8_0}; do
        shape=${spec%%:*}; q=${spec##*:}; f=/tmp/vkengine-bench-models/llama-$shape-$q.gguf
        [ -f "$f" ] || python3 -m vkengine.cli synth --shape "$shape" --quant "$q" --out /tmp/vkengine-bench-models \
          --name "llama-$shape" --formats gguf --tokenizer-from "$VKENGINE_TOKENIZER_GGUF" >/dev/null
        python3 -m vkengine.cli bench -m "$f" -p 512 -n 32 -r 1 --profile ${PROFILE_ARGS:-} 2>&1 | tee -a "$OUT/profile.log"
      done
      ;;
    qwen35)
      # hybrid models: kernels, tiny-model tests (llama-server checks use the Vulkan build when present),
      # then Hugging Face transformers as the oracle
      [ -x /tmp/llb/bin/llama-server ] && export VKENGINE_LLAMA_SERVER=/tmp/llb/bin/llama-server
      python3 -m pytest -q -p no:cacheprovider tests/test_kernels_qwen35.py tests/test_models_qwen35.py \
        tests/test_mtp_qwen35.py tests/test_gguf_qwen35.py tests/test_speculate.py tests/test_synth_mtp_accept.py \
        tests/test_server_mtp.py --junitxml="$OUT/gpu-qwen35.xml" 2>&1 \
        | tee "$OUT/gpu-qwen35.log" | tail -15
      python3 tests/gpu/hf_oracle_qwen35.py 2>&1 | tee "$OUT/hf-oracle-qwen35.log"
      ;;
    synth)
      # write the BENCH_QWEN models ahead of the bench stage (e.g. "qwen35+synth bench")
      for spec in ${BENCH_QWEN:-}; do
        t0=$SECONDS; f=$(synth_model "$spec") && echo "synth $spec: $f, $(du -h "$f" | cut -f1), $((SECONDS - t0)) s"
      done
      ;;
    bench)
      build_llama && lb=/tmp/llb/bin/llama-bench || lb=""
      files=""
      for spec in ${BENCH_QWEN:-}; do   # arch:shape:quant, e.g. qwen35:0.8B:q4_0
        f=$(synth_model "$spec") && files=${files:+$files,}$f
      done
      python3 bench/bench.py --out "$OUT/bench" --tokenizer-from "$VKENGINE_TOKENIZER_GGUF" \
        ${BENCH_MODELS:+--models=${BENCH_MODELS#none}} ${files:+--files $files} ${lb:+--llama-bench $lb} \
        -r "${BENCH_REPS:-3}" ${BENCH_PARALLEL:+--parallel $BENCH_PARALLEL} ${BENCH_DEPTHS:+--depth $BENCH_DEPTHS} ${BENCH_KV:+-ctk $BENCH_KV -ctv $BENCH_KV} --llama-label "llama.cpp 11434 Vulkan (int dot + coopmat)" 2>&1 | tee "$OUT/bench.log" | tail -20
      ;;
    parity)
      # our tokens vs llama-server's Vulkan build (-ngl 99) on the same synthetic GGUFs
      build_llama
      mkdir -p "$OUT/parity"
      for spec in ${PARITY_MODELS:-llama:smollm2-135m:q4_1 qwen35:tiny:q8_0 qwen35moe:tiny:q8_0}; do
        f=$(synth_model "$spec") || continue
        name=$(basename "$f" .gguf)
        timeout "${PARITY_TIMEOUT:-300}" python3 -m parity.cli run --model "$f" --server /tmp/llb/bin/llama-server \
          --server-args="-ngl 99" --out "$OUT/parity/$name-h200-vs-llamacpp-vulkan.json" 2>&1 \
          | tee -a "$OUT/parity.log" | grep -v "^\[parity\]" | tail -3
      done
      ;;
    serve-bench)
      # concurrent streaming clients over HTTP: ours (serial, slices, batch) and
      # llama-server -np C with every layer on the GPU, on the same GGUF
      build_llama
      f=/tmp/vkengine-bench-models/llama-${SERVE_MODEL:-1b-q8_0}.gguf
      [ -f "$f" ] || python3 -m vkengine.cli synth --shape "${SERVE_SHAPE:-1b}" --quant "${SERVE_QUANT:-q8_0}" \
        --out /tmp/vkengine-bench-models --name "llama-${SERVE_SHAPE:-1b}" --formats gguf \
        --tokenizer-from "$VKENGINE_TOKENIZER_GGUF" >/dev/null
      for C in ${SERVE_CLIENTS:-1 4 16}; do
        case $C in 1) cfg=batch ;; 4) cfg=serial,slices,batch ;; *) cfg=serial,batch ;; esac
        cfg=${SERVE_CONFIGS:-$cfg}
        python3 bench/serve.py --model "$f" --clients "$C" --requests "${SERVE_REQUESTS:-2}" -n "${SERVE_TOKENS:-64}" \
          --configs "$cfg" --llama-server /tmp/llb/bin/llama-server --llama-args="-ngl 99" ${SERVE_TEMP:+--temperature $SERVE_TEMP} \
          ${SERVE_REPEAT:+--repeat $SERVE_REPEAT} \
          --json "$OUT/serve-c$C.json" 2>&1 | tee -a "$OUT/serve-bench.log" | tail -8
      done
      ;;
    serve-long)
      # long prompts through the servers (issue 31), ours (batch) vs llama-server -ngl 99 on the same GGUF:
      # (a) one client, prompts of SERVE_LONG random token ids; (b) 4 streams while 4 newcomers arrive
      # with SERVE_MIXED_IDS-token prompts (newcomers' TTFT, streams' ITL while they are in, tok/s)
      build_llama
      f=$(synth_model "${SERVE_LONG_MODEL:-llama:8b:q4_0}") || return 1
      arch=${SERVE_LONG_MODEL%%:*}; arch=${arch:-llama}
      la="-ngl 99 --override-kv $arch.context_length=int:131072"
      for N in ${SERVE_LONG:-4096 16384}; do
        python3 bench/serve.py --model "$f" --clients 1 --requests 2 --prompt-ids "$N" -n 16 --ctx $((N + 64)) \
          --configs batch --llama-server /tmp/llb/bin/llama-server --llama-args="$la" --warmup-s 0 \
          --server-args="${SERVE_ARGS:-}" --json "$OUT/serve-long-$N.json" 2>&1 | tee -a "$OUT/serve-long.log" | tail -4
      done
      M=${SERVE_MIXED_IDS:-8192}
      python3 bench/serve.py --model "$f" --clients 4 -n 256 --newcomers 4 --newcomer-ids "$M" --newcomer-predict 16 \
        --ctx $((M + 64)) --llama-server /tmp/llb/bin/llama-server --llama-args="$la" \
        --server-args="${SERVE_ARGS:-}" --json "$OUT/serve-mixed.json" --keep-logs "$OUT/serve-logs" 2>&1 \
        | tee -a "$OUT/serve-long.log" | tail -5
      ;;
    mtp)
      for spec in ${MTP_MODELS:-qwen35:0.8B:q4_0 qwen35moe:35B-A3B:q4_0}; do
        f=$(synth_model "$spec:accept") || continue
        for C in 1 4; do
          cfg=$([ "$C" = 1 ] && echo serial,serial-mtp || echo batch,batch-mtp)
          python3 bench/serve.py --model "$f" --clients "$C" --requests 2 -n "${MTP_TOKENS:-128}" --configs "$cfg" \
            --draft "${MTP_DRAFT:-2}" --ctx 1024 --json "$OUT/mtp-$(basename "$f" .gguf)-c$C.json" 2>&1 \
            | tee -a "$OUT/mtp.log" | tail -6
        done
      done
      ;;
    moe)
      # issue 34's targets in one call: MOE_MODEL (written with the always-accepted MTP head) against llama-bench,
      # which runs before and after ours (its figures drifted between calls on the H100: notes.md run 45)
      build_llama
      f=$(synth_model "${MOE_MODEL:-qwen35moe:35B-A3B:q4_0}:accept") || return 1
      /tmp/llb/bin/llama-bench -m "$f" -p 512,2048 -n 128 -r 3 -ngl 99 2>&1 | tee -a "$OUT/moe.log" | grep -E "pp|tg"
      python3 -m vkengine.cli bench -m "$f" -p 512 -n 128 -r 3 --ctx 2400 --parallel 4,16 2>&1 | tee -a "$OUT/moe.log" \
        | tail -3
      python3 -m vkengine.cli bench -m "$f" -p 2048 -n 0 -r 2 --ctx 2400 2>&1 | tee -a "$OUT/moe.log" | tail -1
      /tmp/llb/bin/llama-bench -m "$f" -p 0 -n 128 -r 3 -ngl 99 2>&1 | tee -a "$OUT/moe.log" | grep tg
      for d in 2 3; do   # each step of an MTP turn alone
        python3 -m vkengine.cli bench -m "$f" -p 0 -n 64 -r 2 --ctx 1024 --mtp --draft $d 2>&1 | tee -a "$OUT/moe.log" \
          | tail -1
      done
      # the GPU time of each op of those steps, and of a batched decode step of 4 sequences
      python3 -m vkengine.cli bench -m "$f" -p 0 -n 8 -r 1 --ctx 1024 --mtp --draft 3 --parallel 4 --profile \
        > "$OUT/moe-profile.txt" 2>&1
      for C in 1 4; do   # the server: plain against MTP (3 drafts alone, 2 beside three others)
        cfg=$([ "$C" = 1 ] && echo serial,serial-mtp || echo batch,batch-mtp)
        python3 bench/serve.py --model "$f" --clients "$C" --requests 2 -n 128 --configs "$cfg" \
          --draft "$([ "$C" = 1 ] && echo 3 || echo 2)" --ctx 1024 --json "$OUT/moe-mtp-c$C.json" 2>&1 \
          | tee -a "$OUT/moe.log" | grep -E "^\| (serial|batch)"
      done
      ;;
    cold)
      # issue 35's cold start: COLD_MODELS fresh (driver cache off, no saved pipelines) against llama-server,
      # COLD_REPEAT runs each
      build_llama
      for spec in ${COLD_MODELS:-llama:1b:q4_0 llama:8b:q4_0}; do
        f=$(synth_model "$spec") || continue
        python3 bench/cold_start.py --model "$f" --llama-server /tmp/llb/bin/llama-server --threads 16 --runs fresh \
          --repeat "${COLD_REPEAT:-3}" --timeout 30 --json "$OUT/cold-$(basename "$f" .gguf).json" 2>&1 \
          | tee -a "$OUT/cold.log" | grep -E "^\| (ours|llama)"
      done
      ;;
    split)
      build_llama
      n_gpu=$(python3 -m vkengine.cli devices --json | python3 -c \
        'import json, sys; print(sum(d["type"] != "cpu" for d in json.load(sys.stdin)))')
      devs=${SPLIT_DEVICES:-$([ "${n_gpu:-1}" -ge 2 ] && echo 0,1 || echo 0,0)}
      echo "== $n_gpu GPU(s); split over devices $devs" | tee -a "$OUT/split.log"
      python3 -m pytest -q -p no:cacheprovider tests/test_split.py -k "not smollm2" \
        --junitxml="$OUT/gpu-split.xml" 2>&1 | tee "$OUT/gpu-split-tests.log" | tail -5
      f=$(synth_model "${SPLIT_MODEL:-llama:8b:q4_0}") || return 1
      for d in "" "--devices $devs"; do   # bench/bench.py rows (docs/bench): llama-bench -sm none, then -sm layer
        echo "== bench/bench.py ${d:-(one device)}" | tee -a "$OUT/split.log"
        python3 bench/bench.py --out "$OUT/bench" --models= --files "$f" --llama-bench /tmp/llb/bin/llama-bench \
          -r 2 --parallel 4,16 $d --llama-label "llama.cpp 11434 Vulkan (int dot + coopmat)" 2>&1 \
          | tee -a "$OUT/split.log" | tail -4
      done
      for C in 4 16; do
        python3 bench/serve.py --model "$f" --clients "$C" --requests 2 -n 64 --configs batch \
          --llama-server /tmp/llb/bin/llama-server --llama-args="-ngl 99 -sm none" \
          --json "$OUT/split-serve-whole-c$C.json" 2>&1 | tee -a "$OUT/split.log" | tail -4
        python3 bench/serve.py --model "$f" --clients "$C" --requests 2 -n 64 --configs batch \
          --server-args="--devices $devs" --llama-server /tmp/llb/bin/llama-server --llama-args="-ngl 99 -sm layer" \
          --json "$OUT/split-serve-split-c$C.json" 2>&1 | tee -a "$OUT/split.log" | tail -4
      done
      if [ -n "${SPLIT_CAP_MIB:-}" ]; then   # a model over one (capped) device's memory: refused whole, served split
        g=$(synth_model "${SPLIT_BIG_MODEL:-qwen35moe:35B-A3B:q4_0}") || return 1
        for d in "" "--devices $devs"; do
          echo "== VKENGINE_MEMORY_MIB=$SPLIT_CAP_MIB vkengine bench ${d:-(one device)}" | tee -a "$OUT/split.log"
          VKENGINE_MEMORY_MIB=$SPLIT_CAP_MIB python3 -m vkengine.cli bench -m "$g" -p 512 -n 128 -r 2 \
            --parallel 1,4 $d 2>&1 | tee -a "$OUT/split.log" | tail -4
        done
        /tmp/llb/bin/llama-bench -m "$g" -p 512 -n 128 -r 2 -ngl 99 -sm layer 2>&1 | tee -a "$OUT/split.log" | tail -4
      fi
      ;;
    cmd)
      # any command in this environment (GPU_CMD), e.g. a tuning script
      eval "${GPU_CMD:?set GPU_CMD}" 2>&1 | tee -a "$OUT/cmd.log"
      ;;
    *) echo "unknown stage $s"; return 2 ;;
  esac
}

# A stage list like "tests+parity bench" runs tests and parity at once (both
# check correctness, so sharing the GPU does not matter), then bench alone.
# Each stage has a time limit (T_<stage> seconds, default 590) so that one
# that hangs cannot eat the rest of the call.
stage_timeout() { local v="T_${1//-/_}"; echo "${!v:-590}"; }
case " $stages " in *tests\ *|*parity*|*bench*|*qwen35*|*llama*|*serve-long*|*moe*|*split*) build_llama ;; esac
export -f build_llama synth_model run_stage
for group in $stages; do
  if [ "${group#*+}" = "$group" ]; then
    timeout "$(stage_timeout "$group")" bash -c "run_stage $group" || echo "stage $group: exit $?"
  else
    pids=()
    for s in ${group//+/ }; do
      (timeout "$(stage_timeout "$s")" bash -c "run_stage $s" \
        > "$OUT/stage-$s.log" 2>&1; echo "stage $s: exit $?" >> "$OUT/stage-$s.log") &
      pids+=($!)
    done
    wait "${pids[@]}"
    for s in ${group//+/ }; do tail -6 "$OUT/stage-$s.log"; done
  fi
done


# The device tool brings back at most 8 files: past that, pack $OUT into one.
# The llama.cpp build's parts stay separate files (each under the 16 MiB a file may have).
if [ "$(find "$OUT" -type f | wc -l)" -gt 8 ]; then
  tar czf /tmp/vkengine-results.tgz --exclude='./llama-vulkan.tar.xz.part*' -C "$OUT" . \
    && find "$OUT" -mindepth 1 ! -name 'llama-vulkan.tar.xz.part*' -delete && mv /tmp/vkengine-results.tgz "$OUT/results.tgz"
  echo "results packed into \$OUT/results.tgz"
fi
