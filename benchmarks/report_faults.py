"""The section of docs/benchmarks.md on issue 29: `benchmarks/soak.py` under -dp 2, with no faults and with a rank
of each replica killed or stopped in turn (soak_dp2.json, soak_faults.json)."""

from __future__ import annotations

from report_sections import Results, _missing, md_table

TITLE = "## Soak with faults: -dp 2, a replica's rank killed or stopped in turn (issue 29)"


def _overview(base: dict, faults: dict) -> list[str]:
    f = faults["faults"]
    rows = []
    for name, data in (("no faults", base), (f"a fault every {f['every_s']:g} s", faults)):
        book = data.get("faults") or {}
        rows.append({"run": name, "duration_s": data["duration_s"], "requests": data["requests"],
                     "served": book.get("served", data["latency_s"]["completed"]),
                     "failed over": book.get("failed_over", 0), "errored": book.get("errored", 0),
                     "lost": book.get("lost", 0), "output tokens/s": data["output_tokens_per_s"],
                     "latency p50 / p99 s": f"{data['latency_s']['p50']} / {data['latency_s']['p99']}",
                     "problems": len(data["problems"])})
    return md_table(rows)


def _faults(faults: dict) -> list[str]:
    rows = [{"#": i + 1, "replica": x["replica"], "fault": "SIGKILL" if x["kind"] == "kill" else "SIGSTOP",
             "rank": x["rank"], "detected after s": x["detect_s"], "serving again after s": x["recover_s"]}
            for i, x in enumerate(faults["faults"]["injected"])]
    return md_table(rows)


def faults_section(results: Results, images: str, rel: str) -> list[str]:
    base, faults = results.get("soak_dp2"), results.get("soak_faults")
    lines = [TITLE, ""]
    if base is None or faults is None:
        return lines + _missing("faults")
    f = faults["faults"]
    lines += ["`benchmarks/soak.py` (SmolLM2, 8 clients of mixed traffic, see docs/serve.md \"Fuzzing and soak\") "
              "against `cpllm serve -dp 2 --distributed-timeout 10 --threads-per-rank 1`, once with no faults and "
              f"once with `--faults {f['every_s']:g}`: every {f['every_s']:g} s the next replica (0, 1, 0, ...) gets "
              "SIGKILL or SIGSTOP (alternating per replica) on one of its ranks. \"Served\": requests that "
              "completed; \"failed over\": of those, the ones moved to the other replica before their first "
              "token (the client saw nothing); \"errored\": requests that had sent tokens when their replica "
              "failed, ended with an error event or a 503 naming it; \"lost\": neither (the target: 0). "
              "Detection: until /health shows the replica out of rotation; recovery: until it serves again (a "
              "new process tree importing torch and loading the model, on the same 2 shared cores).", ""]
    lines += _overview(base, faults) + [""]
    for name, data in (("no faults", base), ("faults", faults)):
        for problem in data["problems"]:
            lines.append(f"Problem reported by the {name} run: {problem}.")
    if base["problems"] or faults["problems"]:
        lines.append("")
    lines += _faults(faults) + [""]
    tokens, seconds = f["output_tokens_per_s"], f["seconds"]
    lines.append(f"Detection: mean {f['detect_s']['mean']} s, max {f['detect_s']['max']} s; recovery: mean "
                 f"{f['recover_s']['mean']} s, max {f['recover_s']['max']} s. Output tokens/s in the fault run: "
                 f"{tokens['healthy']} with both replicas serving ({seconds['healthy']} s) and {tokens['degraded']} "
                 f"with one out ({seconds['degraded']} s: the restarting replica's start-up competes for the two "
                 f"cores); {base['output_tokens_per_s']} over the run with no faults.")
    return lines


FAULT_SECTIONS = [faults_section]
