"""Reading back what an offline wandb run logged (WANDB_MODE=offline): its `run-ID.wandb` file is a LevelDB-style
log of protobuf `Record`s (wandb's own format: a 7-byte ':W&B' header, then 32 KiB blocks of chunks, each with a
7-byte header: CRC-32C, length, type FULL/FIRST/MIDDLE/LAST). wandb 0.31 no longer ships a Python reader."""

import glob
import json
import os
import struct

_BLOCK, _HEADER = 32768, 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _chunks(data: bytes):
    assert data[:4] == b":W&B", "not a wandb run file"
    pos, pending = _HEADER, b""
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # a block's tail too short for a header is padding
            pos += left
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        body, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == _FULL:
            yield body
        elif kind == _FIRST:
            pending = body
        elif kind == _MIDDLE:
            pending += body
        elif kind == _LAST:
            yield pending + body
        else:  # zeros: the end of what was written
            return


def offline_run(save_dir: str) -> dict:
    """{"config": {key: value}, "history": [{"_step": n, tag: value, ...}], "name": ..., "project": ...} of the one
    offline run under `save_dir`/wandb."""
    from wandb.proto import wandb_internal_pb2

    files = glob.glob(os.path.join(save_dir, "wandb", "offline-run-*", "run-*.wandb"))
    assert len(files) == 1, files
    with open(files[0], "rb") as f:
        data = f.read()
    run = {"config": {}, "history": []}
    for chunk in _chunks(data):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(chunk)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.update(name=record.run.display_name, project=record.run.project)
            run["config"].update({item.key: json.loads(item.value_json) for item in record.run.config.update})
        elif kind == "config":
            run["config"].update({item.key: json.loads(item.value_json) for item in record.config.update})
        elif kind == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            run["history"].append({**row, "_step": record.history.step.num})
    return run
