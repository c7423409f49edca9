#!/usr/bin/env bash
# Regenerate every result under benchmarks/results/ and docs/benchmarks.md (with its plots).
#   benchmarks/run_all.sh            # everything (about two hours on 2 cores)
#   benchmarks/run_all.sh prefill    # one step: ceiling prefill comm memory decode tp compare quality attention int4 profile serve chunk
#                                    #   decode_layouts dcp transport plan breakdown moe structure startup window mla spec faults report
# Threads are always explicit: more busy threads than cores make torch's OpenMP spin-waits ruinous.
set -euo pipefail
cd "$(dirname "$0")/.."
R=benchmarks/results
IMG=docs/img
mkdir -p "$R" "$IMG"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(ceiling prefill comm memory decode tp compare quality attention int4 profile serve chunk decode_layouts dcp transport plan
                                 breakdown moe structure layer-kinds startup window mla spec faults hybrid sparse-chunk
                                 disagg report)
bench() { python -m cpllm --log-level WARNING bench "$@"; }

for step in "${steps[@]}"; do
  echo "== $step (load: $(cut -d' ' -f1-3 /proc/loadavg))"
  case "$step" in
    ceiling) bench ceiling --threads 1,2 --json "$R/ceiling.json" ;;
    prefill) bench prefill --lengths 1024,4096,8000 --layouts 1x1x1@1,1x1x1@2,1x2x1@1 \
               --strategies allgather,ring --repeats 2 --json "$R/prefill_pcp.json" --plot "$IMG/prefill_pcp.png" ;;
    comm) bench comm --lengths 2048,8000 --threads-per-rank 1 --json "$R/comm.json" ;;
    memory) bench memory --cp-sizes 1,2,4 --budget 64MiB --threads-per-rank 1 --json "$R/memory.json" ;;
    decode) bench decode --layouts 1x1x1@2,1x2x1@1 --batch-sizes 1,16 --context-lengths 128,2048 \
              --shared-prefix --steps 32 --json "$R/decode_cpllm.json" --plot "$IMG/decode_cpllm.png" ;;
    tp) bench prefill --lengths 1024 --layouts 1x1x1@1,1x1x1@2,3x1x1@1 --json "$R/tp_prefill.json"
        bench decode --layouts 1x1x1@1,1x1x1@2,3x1x1@1 --batch-sizes 1,16 --context-lengths 128 --shared-prefix \
          --steps 16 --json "$R/tp_decode.json" ;;
    compare) python benchmarks/compare.py --lengths 2048 --threads 1,2 --prefill-repeats 3 \
               --decode-contexts 128,2048 --decode-batches 1,16 --decode-threads 1,2 --out "$R/compare.json" ;;
    # issue 10: approximate formats against fp32, and the decode step against the commit before the decode work
    quality) python benchmarks/quality.py --threads 2 --formats auto,int8,int4 --out "$R/quality.json" ;;
    attention) python benchmarks/decode_attention.py --json "$R/decode_attention.json"
               python benchmarks/prefill_attention.py --json "$R/prefill_attention.json"
               python benchmarks/prefill_attention_ways.py --json "$R/attention_ways.json" ;;
    int4) python benchmarks/int4_kernel.py --json "$R/int4_kernel.json" ;;
    profile) python benchmarks/profile_before_after.py --before e89de9e --threads 2 --pairs 2 \
               --out "$R/decode_profile.json" ;;
    serve) bench serve --threads-per-rank 2 --num-requests 32 --concurrency 8 --prompt-tokens 256 \
             --output-tokens 64 --json "$R/serve.json" --plot "$IMG/serve.png" ;;
    # issue 12: fp32 weights (--quantization none), the format the planner's figures are for
    chunk) bench chunk --context 7900 --chunk 256 --layouts 1x1x1@2,1x2x1@1 --strategies ring,pass-q,auto \
             --repeats 5 --quantization none --json "$R/chunk_pcp.json" ;;
    # five rounds per layout, in rotated order; every ratio compares PCP=2 with the one-rank run of its round
    decode_layouts) bench decode --layouts 1x1x1@1,1x1x1@2,1x2x1@1 --batch-sizes 1,16 --context-lengths 2048 \
          --shared-prefix --steps 32 --rounds 5 --cp-kv-cache-layout sharded --json "$R/decode_pcp_sharded.json"
        bench decode --layouts 1x1x1@2,1x2x1@1 --batch-sizes 1,16 --context-lengths 2048 --shared-prefix \
          --steps 32 --rounds 5 --cp-kv-cache-layout replicated --json "$R/decode_pcp_replicated.json"
        # the same sharded run over gloo alone (as before the shared-memory transport), single rank for reference
        bench decode --layouts 1x1x1@2,1x2x1@1 --batch-sizes 1,16 --context-lengths 2048 --shared-prefix \
          --steps 32 --collective-transport gloo --json "$R/decode_pcp_gloo.json" ;;
    # issue 10: DCP=2 (with TP=2) on SmolLM2's shape with one KV head, against one rank; five rounds
    dcp) python benchmarks/dcp_decode.py --rounds 5 --out "$R/decode_dcp.json" ;;
    transport) python benchmarks/collective_latency.py --ranks 2 --json "$R/collective_latency.json" ;;
    # issue 24: the figures the structural change must not move, against the commit before it
    startup) python benchmarks/startup.py --before ef50ece --rounds 3 --out "$R/startup.json" ;;
    structure) python benchmarks/structure_before_after.py --before 45527f0 --rounds 4 --out "$R/structure.json"
        python benchmarks/structure_before_after.py --before 45527f0 --rounds 4 --cases 5 \
          --out "$R/structure_tp_team.json" ;;
    # issue 36: the layer-kind change against the commit before it
    layer-kinds) python benchmarks/structure_before_after.py --before 0ddc6ad --rounds 2 --cases 1,2,3 \
          --out "$R/structure_layer_kinds.json" ;;
    # issue 11: random Qwen3-MoE-shaped model (16 layers, hidden 1024, 64 experts of 256, top-8), saved once
    moe) python benchmarks/moe_bench.py --threads 1 --prefill-tokens 1024,4096 --pcp-tokens 4096 --repeats 3 \
           --pcp-repeats 2 --out "$R/moe.json"
         python benchmarks/profile_moe.py --tokens 1024,4096 --json "$R/moe_profile.json" ;;
    # issue 31: a random model of Gemma 3 1B's shape (26 layers) and a 32K vocabulary (benchmarks/window_model.py)
    window) python benchmarks/window_bench.py --part prefill --layers 26 --lengths 2048,4096 --rounds 2 --threads 1 \
              --out "$R/window_prefill.json"
            python benchmarks/window_bench.py --part pcp --layers 26 --pcp-tokens 16384 --rounds 1 \
              --out "$R/window_pcp.json"
            python benchmarks/window_bench.py --part decode --layers 26 --context 32768 --rounds 3 --steps 8 \
              --threads 1 --out "$R/window_decode.json" ;;
    # issue 26: prompt lookup on SmolLM2, copy and chat workloads: one rank, PCP=2, and 16 requests at once
    spec) for length in adaptive fixed; do
            suffix=$([ $length = fixed ] && echo _fixed || true)
            python benchmarks/spec_decode.py --repeats 3 --draft-length $length --json "$R/spec_decode$suffix.json"
            python benchmarks/spec_decode.py --repeats 2 --batch 16 --max-tokens 128 --kv-cache-memory $((1536 << 20)) \
              --draft-length $length --json "$R/spec_decode_batch16$suffix.json"
          done
          python benchmarks/spec_decode.py --repeats 5 --pcp 2 --threads-per-rank 1 --json "$R/spec_decode_pcp2.json" ;;
    # issue 25: a random model of DeepSeek-V2-Lite's per-layer shape cut to 2 layers and a 32K vocabulary
    mla) python benchmarks/mla_bench.py --part dcp --context 16384 --rounds 6 --steps 32 --out "$R/mla_dcp.json"
         python benchmarks/mla_bench.py --part layer --contexts 2048,16384 --rounds 5 --threads 1 \
           --out "$R/mla_layer.json"
         python benchmarks/mla_bench.py --part prefill --lengths 2048,4096 --rounds 3 --threads 1 \
           --out "$R/mla_prefill.json" ;;
    # issue 29: soaks of -dp 2 with no faults, then a replica's rank killed or stopped every 25 s
    faults) python benchmarks/soak.py --duration 150 --clients 8 --json "$R/soak_dp2.json" -- -dp 2 \
              --distributed-timeout 10 --threads-per-rank 1 || true
            python benchmarks/soak.py --duration 150 --clients 8 --faults 25 --json "$R/soak_faults.json" -- -dp 2 \
              --distributed-timeout 10 --threads-per-rank 1 || true ;;
    plan) bench plan --lengths 4096,8000 --repeats 3 --quantization none --json "$R/plan_check.json" ;;
    breakdown) python benchmarks/profile_prefill.py --lengths 4096,8000 --repeats 2 \
                 --json "$R/prefill_breakdown.json" ;;
    hybrid) python benchmarks/hybrid_bench.py --parts bytes,prefill,pcp,decode --lengths 4096,16384 \
              --pcp-length 16384 --context 32768 --rounds 2 --out "$R/hybrid_bench.json" ;;
    sparse-chunk) python benchmarks/sparse_mla_bench.py --part chunk --contexts 4096,16384 --chunk 256 --rounds 2 \
                    --out "$R/sparse_mla_chunk.json" ;;
    disagg) python benchmarks/disagg_mixed.py --long-tokens 7900 --longs 3 --long-interval-s 12 --chats 4 \
              --json "$R/disagg_mixed.json" ;;
    report) python benchmarks/make_report.py --results "$R" --out docs/benchmarks.md --images "$IMG" ;;
    *) echo "unknown step: $step" >&2; exit 2 ;;
  esac
done
