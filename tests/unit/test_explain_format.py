"""How ``umbra jobs explain`` lays out an answer (pure)."""

from __future__ import annotations

from umbra.cli_jobs import format_explanation


def test_ranked_devices_show_residency_and_evictions_and_device_less_nodes_say_so():
    body = {
        "summary": "Can run on 2 devices; ...",
        "placement": None,
        "eligible": [
            {"node_name": "a", "device_label": "gpu0", "via": "vram", "score": 8.0, "resident": True, "would_evict": [],
             "placement_reason": "placed:gpu_discrete"},
            {"node_name": "b", "device_label": "m4", "via": "ram", "score": 0.84, "resident": False,
             "would_evict": ["phi", "qwen"], "placement_reason": "placed:slow_path:ram_not_vram"},
        ],
        "ineligible": [
            {"node_name": "empty", "device_label": None, "reason": "node_offline", "needed_mb": None},
            {"node_name": "new", "device_label": None, "reason": None, "needed_mb": None},
        ],
    }  # fmt: skip
    lines = format_explanation(body)
    assert lines[:3] == ["Can run on 2 devices; ...", "", "eligible, best first:"]
    assert lines[3].split() == ["1.", "a/gpu0", "via", "vram", "score", "8", "placed:gpu_discrete", "resident"]
    assert lines[4].split() == ["2.", "b/m4", "via", "ram", "score", "0.84", "placed:slow_path:ram_not_vram", "evicts", "phi,qwen"]
    assert lines[5] == "ineligible:"
    assert lines[6].split() == ["empty", "(no", "devices)", "node_offline"]
    assert lines[7].split() == ["new", "(no", "devices)", "no", "reason:", "reports", "no", "devices"]


def test_a_placed_job_prints_its_recorded_placement():
    body = {
        "summary": "Complete on gpu-box/gpu0 after attempt 1.",
        "placement": {"node_id": "6f1c", "device_id": "gpu0", "via": "vram", "reason": "placed:gpu_discrete"},
        "placement_node_name": "gpu-box",
        "eligible": [],
        "ineligible": [],
    }
    assert format_explanation(body) == [
        "Complete on gpu-box/gpu0 after attempt 1.", "", "placement: gpu-box/gpu0 via vram (placed:gpu_discrete)",
    ]  # fmt: skip
    assert format_explanation({**body, "placement": None}) == [body["summary"], "", "no devices to judge"]


def test_a_waiting_job_lists_what_it_depends_on_before_the_devices():
    body = {
        "summary": "Waiting for 1 of the 2 jobs it depends on to complete: b (running). ...",
        "dependencies": [{"job_id": "a", "status": "complete"}, {"job_id": "b", "status": "running"}],
        "placement": None, "eligible": [], "ineligible": [],
    }  # fmt: skip
    assert format_explanation(body) == [body["summary"], "", "depends on:", "  a  complete", "  b  running", "",
                                         "no devices to judge"]  # fmt: skip
