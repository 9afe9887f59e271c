"""toolkit/triage/snapshot.py: reading a CUDA allocator snapshot without torch or a GPU.

No GPU here: FAKE_SNAPSHOT is a literal dict shaped like torch.cuda.memory._snapshot() (torch 2.x docstring:
segments -> blocks -> frames, device_traces of events), pickled the way torch.cuda.memory._dump_snapshot does.
"""

import pickle

import pytest

from toolkit.triage import snapshot

MIB = 2**20


def frame(filename, line, name):
    return {"filename": filename, "line": line, "name": name}


ALLOC = [frame("/opt/torch/cuda/memory.py", 10, "_record"),  # allocator machinery: left out of stacks
         frame("/usr/lib/python3/site-packages/torch/nn/modules/linear.py", 125, "forward"),
         frame("/home/u/train.py", 88, "training_step"),
         frame("/home/u/train.py", 140, "main")]
LEAKED = [frame("/home/u/train.py", 95, "training_step"), frame("/home/u/train.py", 140, "main")]

FAKE_SNAPSHOT = {
    "segments": [
        {"device": 0, "address": 0x7F0000000000, "total_size": 1024 * MIB, "allocated_size": 900 * MIB,
         "active_size": 900 * MIB, "stream": 0, "segment_type": "large", "segment_pool_id": (0, 0),
         "blocks": [
             {"size": 600 * MIB, "requested_size": 600 * MIB - 17, "address": 0x7F0000000000,
              "state": "active_allocated", "frames": LEAKED},
             {"size": 300 * MIB, "requested_size": 300 * MIB, "address": 0x7F0025800000,
              "state": "active_allocated", "frames": ALLOC},
             {"size": 124 * MIB, "requested_size": 124 * MIB, "address": 0x7F0038400000,
              "state": "inactive", "frames": []},
         ]},
        {"device": 0, "address": 0x7F1000000000, "total_size": 2 * MIB, "allocated_size": 1 * MIB,
         "active_size": 1 * MIB, "stream": 0, "segment_type": "small", "segment_pool_id": (0, 0),
         "blocks": [{"size": MIB // 2, "requested_size": 512, "address": 0x7F1000000000,
                     "state": "active_allocated", "frames": LEAKED},
                    {"size": MIB // 2, "requested_size": 512, "address": 0x7F1000080000,
                     "state": "active_awaiting_free", "frames": ALLOC}]},
    ],
    "device_traces": [[
        {"action": "alloc", "addr": 0x7F0000000000, "size": 600 * MIB, "stream": 0, "frames": LEAKED},
        {"action": "oom", "size": 2048 * MIB, "stream": 0, "device_free": 90 * MIB, "frames": ALLOC},
    ]],
}


def test_summary_names_the_largest_live_tensors_and_their_stacks():
    s = snapshot.summarise(FAKE_SNAPSHOT, top=2)
    assert s["reserved_mib"] == 1026 and s["allocated_mib"] == 900.5 and s["live_tensors"] == 3
    first, second = s["largest"]
    assert first["size_mib"] == 600 and first["stack"] == ["/home/u/train.py:95 in training_step",
                                                            "/home/u/train.py:140 in main"]
    assert second["size_mib"] == 300
    assert second["stack"][0] == "/usr/lib/python3/site-packages/torch/nn/modules/linear.py:125 in forward"
    assert s["by_site"][0] == {"site": "/home/u/train.py:95 in training_step", "mib": 600.5}
    assert s["oom"] == {"size_mib": 2048, "device_free_mib": 90, "stack": [
        "/usr/lib/python3/site-packages/torch/nn/modules/linear.py:125 in forward",
        "/home/u/train.py:88 in training_step", "/home/u/train.py:140 in main"]}


def test_the_pickle_torch_writes_is_read(tmp_path):
    path = tmp_path / "memory-snapshot-rank0.pickle"
    path.write_bytes(pickle.dumps(FAKE_SNAPSHOT))  # what _dump_snapshot does: pickle.dump(snapshot dict)
    assert snapshot.find_snapshots(tmp_path) == [path]
    out = snapshot.describe(path)
    assert out["viewer"] == "https://pytorch.org/memory_viz" and out["error"] is None
    assert out["summary"]["largest"][0]["size_mib"] == 600


class Evil:
    def __reduce__(self):
        return (print, ("ran",))


@pytest.mark.parametrize("payload, says", [
    (b"not a pickle", "not a readable allocator snapshot"),
    (pickle.dumps([1, 2]), "no 'segments' list"),
    (pickle.dumps({"segments": [], "x": Evil()}), "refusing builtins.print"),
    (pickle.dumps(FAKE_SNAPSHOT)[:100], "not a readable allocator snapshot"),
])
def test_bad_files_are_one_line_errors_and_run_nothing(tmp_path, payload, says, capsys):
    path = tmp_path / "memory-snapshot-rank3.pickle"
    path.write_bytes(payload)
    out = snapshot.describe(path)
    assert out["summary"] is None and says in out["error"] and "\n" not in out["error"]
    assert "ran" not in capsys.readouterr().out


def test_an_empty_snapshot():
    s = snapshot.summarise({"segments": [], "device_traces": []})
    assert s == {"reserved_mib": 0, "allocated_mib": 0, "live_tensors": 0, "largest": [], "by_site": [], "oom": None}
