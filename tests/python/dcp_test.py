"""torch.distributed.checkpoint (DCP) through zeroshard.torch.dcp, with a real
shard_server and real processes.

FSDP2 at W = 2 and HSDP on a 2x2 mesh (W = 4) train 5 steps and dcp.save
get_state_dict(model, optimizer) through zt.dcp.StorageWriter: each rank writes only its
local shards; `shardctl consolidate` gives tensors bitwise equal to the full state dict
torch gathers (get_model_state_dict / get_optimizer_state_dict, full_state_dict=True),
and `--weights_only --max_shard_bytes` a Hugging Face sharded set with its
model.safetensors.index.json that transformers' load_sharded_checkpoint loads bitwise;
dcp.load through zt.dcp.StorageReader at W = 1 and W = 3 gives back exactly the saved
state (param_groups included), and step 6 is the uninterrupted run's within
fsdp_error_model's bound.

In one process (an explicit client=, upload instead of a shared root): entries DCP
keeps as bytes come back exactly; a damaged piece, a step without its manifest and a
pickled object of a class the restricted unpickler does not know are each refused with
an error that names them."""
import json
import os
import shutil
import unittest

import harness  # noqa: F401 (puts the built package on sys.path)
from harness import ClusterTest

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import load_file
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from fsdp_program import build
from fsdp_test import LAYERS, SAVE_AT, WIDTH, FsdpRuns

import zeroshard
import zeroshard.torch as zt


class DcpFsdp2Test(FsdpRuns):
    def check_mesh(self, job, world, mesh):
        ref5, ref6 = self.reference(job, world, mesh, "--dcp")
        step_dir = self.assert_local_shards_only(job, ref5)
        self.assert_consolidated_is_the_full_state(load_file(self.consolidate(job)), ref5)
        self.check_hugging_face_set(job, ref5)
        for new_world in (1, 3):
            self.resume_and_check(job, new_world, step_dir, ref5, ref6, "--dcp")
        return step_dir

    def check_hugging_face_set(self, job, ref5):
        from transformers.modeling_utils import load_sharded_checkpoint
        # 3 layers of 40 x 40 + 40 floats: 6,560 bytes each, so 8,000-byte shards make 3.
        hf = self.consolidate(job, "--weights_only", "--max_shard_bytes=8000", name=f"{job}-hf")
        with open(os.path.join(hf, "model.safetensors.index.json")) as f:
            index = json.load(f)
        self.assertEqual(sorted(index["weight_map"]), sorted(ref5["model"]))
        self.assertEqual(len(set(index["weight_map"].values())), LAYERS)
        model = build(WIDTH, LAYERS)
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        load_sharded_checkpoint(model, hf, strict=True)
        for k, v in model.state_dict().items():
            self.assertTrue(torch.equal(v, ref5["model"][k]), k)

    def test_fsdp2_on_a_1d_mesh_of_2_through_dcp_consolidates_and_resumes_at_1_and_3(self):
        self.check_mesh("dcp", 2, "")

    def test_hsdp_on_a_2x2_mesh_through_dcp_saves_one_replica_and_resumes_at_1_and_3(self):
        step_dir = self.check_mesh("hdcp", 4, "2x2")
        for r in (2, 3):  # the second replica's files hold no tensor
            self.assertEqual(load_file(os.path.join(step_dir, f"rank-{r}-of-4.safetensors")), {})


class Opaque:
    """A class the restricted unpickler (torch.load(weights_only=True)) does not know."""

    def __init__(self, x):
        self.x = x


def small_model():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(8, 6), nn.GELU(), nn.Linear(6, 4))


def trained(model):
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for i in range(3):
        opt.zero_grad()
        model(torch.randn(5, 8, generator=torch.Generator().manual_seed(i))).square().sum() \
            .backward()
        opt.step()
    return opt


class DcpOneProcessTest(ClusterTest):
    def setUp(self):
        super().setUp()
        self.client = zeroshard.Client(self.server.address)
        self.client.join("solo", 1, "w0", timeout=30)

    def tearDown(self):
        self.client.close()
        super().tearDown()

    def save(self, step, state):
        dcp.save(state, storage_writer=zt.dcp.StorageWriter(step, client=self.client))
        return os.path.join(self.server.checkpoint_root, "solo", f"step-{step}")

    def fresh_state(self, extras):
        model = small_model()
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        opt = torch.optim.AdamW(model.parameters(), lr=0.5)
        model_sd, optim_sd = get_state_dict(model, opt)
        return model, opt, {"model": model_sd, "optim": optim_sd, **extras}

    def test_a_step_saved_with_an_explicit_client_loads_back_exactly(self):
        model = small_model()
        opt = trained(model)
        model_sd, optim_sd = get_state_dict(model, opt)
        extras = {"epoch": 7, "betas_like": (0.5, [1, None]), "blob": b"\x00\xffzeroshard",
                  "counter": torch.arange(5, dtype=torch.int64), "scale": torch.tensor(2.5)}
        step_dir = self.save(3, {"model": model_sd, "optim": optim_sd, **extras})
        self.assertEqual([(c["step"], c["complete"]) for c in self.client.checkpoints("solo")],
                         [(3, True)])
        self.assertTrue(os.path.exists(os.path.join(step_dir, "manifest.json")))

        model2, opt2, state = self.fresh_state(
            {"epoch": 0, "betas_like": (0.0, [0, None]), "blob": b"",
             "counter": torch.zeros(5, dtype=torch.int64), "scale": torch.tensor(0.0)})
        dcp.load(state, storage_reader=zt.dcp.StorageReader(step_dir))
        set_state_dict(model2, opt2, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        for k, v in model.state_dict().items():
            self.assertTrue(torch.equal(model2.state_dict()[k], v), k)
        want, got = opt.state_dict(), opt2.state_dict()
        self.assertEqual(got["param_groups"], want["param_groups"])  # lr 0.01, not 0.5
        for i, st in want["state"].items():
            for m in ("step", "exp_avg", "exp_avg_sq"):
                self.assertTrue(torch.equal(got["state"][i][m], st[m]), (i, m))
        self.assertEqual((state["epoch"], state["betas_like"], state["blob"]),
                         (7, (0.5, [1, None]), b"\x00\xffzeroshard"))
        self.assertTrue(torch.equal(state["counter"], extras["counter"]))
        self.assertTrue(torch.equal(state["scale"], extras["scale"]))

        # The same step through "latest" and the server's root.
        _, _, again = self.fresh_state({k: v for k, v in state.items()
                                        if k not in ("model", "optim")})
        dcp.load(again, storage_reader=zt.dcp.StorageReader(
            "latest", root=self.server.checkpoint_root, client=self.client))
        self.assertTrue(torch.equal(again["model"]["2.weight"], model.state_dict()["2.weight"]))

    def test_a_damaged_piece_is_refused_naming_the_file_and_tensor(self):
        model = small_model()
        opt = trained(model)
        model_sd, optim_sd = get_state_dict(model, opt)
        step_dir = self.save(1, {"model": model_sd, "optim": optim_sd})
        copy = os.path.join(self.dir, "damaged")
        shutil.copytree(step_dir, copy)
        path = os.path.join(copy, "rank-0-of-1.safetensors")
        with open(path, "r+b") as f:  # the last byte of the data: a tensor's
            f.seek(-1, os.SEEK_END)
            last = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([last[0] ^ 0x40]))
        _, _, state = self.fresh_state({})
        # DCP gathers each rank's exception into a CheckpointException with its text.
        with self.assertRaises(CheckpointException) as e:
            dcp.load(state, storage_reader=zt.dcp.StorageReader(copy))
        self.assertRegex(str(e.exception),
                         r"ValueError: .*rank-0-of-1.safetensors: tensor '.*' has XXH64 [0-9a-f]+; "
                         r"the manifest records [0-9a-f]+ \(the file is damaged\)")

    def test_a_step_without_its_manifest_is_not_complete(self):
        model = small_model()
        opt = trained(model)
        model_sd, optim_sd = get_state_dict(model, opt)
        step_dir = self.save(2, {"model": model_sd, "optim": optim_sd})
        copy = os.path.join(self.dir, "incomplete")
        shutil.copytree(step_dir, copy)
        os.remove(os.path.join(copy, "manifest.json"))
        _, _, state = self.fresh_state({})
        with self.assertRaises(CheckpointException) as e:
            dcp.load(state, storage_reader=zt.dcp.StorageReader(copy))
        self.assertIn("incomplete has no manifest.json: the step is not complete",
                      str(e.exception))

    def test_a_pickled_object_goes_through_the_restricted_unpickler_only(self):
        model = small_model()
        step_dir = self.save(4, {"model": model.state_dict(), "thing": Opaque(3)})
        with safe_open(os.path.join(step_dir, "rank-0-of-1.safetensors"), "pt") as f:
            meta = json.loads(f.metadata()["dcp"])
        kinds = {e["key"]: e["kind"] for e in meta["keys"]}
        self.assertEqual(kinds["thing"], "pickle")
        state = {"model": small_model().state_dict(), "thing": Opaque(0)}
        with self.assertRaises(CheckpointException) as e:
            dcp.load(state, storage_reader=zt.dcp.StorageReader(step_dir))
        self.assertRegex(str(e.exception),
                         r"ValueError: .*entry 'thing' is a pickled object that the restricted "
                         r"unpickler .* refuses: .*GLOBAL __main__.Opaque")
        self.assertEqual(state["thing"].x, 0)


if __name__ == "__main__":
    unittest.main(verbosity=2)
