"""Full fine-tuning pieces: every weight trains and the loss falls; bf16 weights with float32 master weights and
gradients (gapless.train.optim.MasterWeights) resume bit-exactly; the result is an HF folder transformers loads."""
import copy

import torch
import torch.nn.functional as F
from torch.testing import assert_close

import gapless
from gapless.config import OptimConfig
from gapless.model.export import save_pretrained
from gapless.train.optim import MasterWeights, build_optimizer, clip_grad_norm

G = torch.Generator().manual_seed(3)
IDS, TARGETS = torch.randint(0, 96, (2, 4, 12), generator=G)  # 4 rows: 2 micro-batches of 2


def _loss(model, ids, targets):
    return F.cross_entropy(model(ids).float().flatten(0, 1), targets.flatten())


def _setup(folder, dtype):
    model = gapless.load_model(folder, dtype=dtype).train()
    model.requires_grad_(True)  # full fine-tuning: every weight trains
    if dtype == torch.float32:
        return model, None, build_optimizer(model.parameters(), OptimConfig(lr=1e-3), "cpu")
    masters = MasterWeights(model.named_parameters())
    return model, masters, build_optimizer(masters.masters, OptimConfig(lr=1e-3), "cpu")


def _step(model, masters, opt):
    for i in range(2):  # two micro-batches, each half of the step's tokens: mean of the two means
        (_loss(model, IDS[i * 2:(i + 1) * 2], TARGETS[i * 2:(i + 1) * 2]) / 2).backward()
    clip_grad_norm(masters.masters if masters else model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    if masters:
        masters.copy_to_model()


def test_full_fine_tuning_lowers_the_loss(hf_checkpoint):
    _, folder = hf_checkpoint("llama")
    for dtype in (torch.float32, torch.bfloat16):
        model, masters, opt = _setup(folder, dtype)
        assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == \
            sum(p.numel() for p in model.parameters())
        with torch.no_grad():
            before = _loss(model, IDS, TARGETS).item()
        for _ in range(15):
            _step(model, masters, opt)
        with torch.no_grad():
            after = _loss(model, IDS, TARGETS).item()
        assert after < 0.7 * before, (dtype, before, after)  # memorising 48 tokens: ~4.6 -> well under 3


def test_master_weights_hold_float32_gradients_and_free_the_bf16_ones(hf_checkpoint):
    _, folder = hf_checkpoint("qwen2")
    model, masters, _ = _setup(folder, torch.bfloat16)
    assert all(m.dtype == torch.float32 for m in masters.masters)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    grads = []
    for i in range(2):
        ref = copy.deepcopy(model)  # deepcopy drops hooks: plain bf16 autograd, one micro-batch at a time
        _loss(ref, IDS[i * 2:(i + 1) * 2], TARGETS[i * 2:(i + 1) * 2]).backward()
        grads.append({n: p.grad.float() for n, p in ref.named_parameters()})
    for i in range(2):
        _loss(model, IDS[i * 2:(i + 1) * 2], TARGETS[i * 2:(i + 1) * 2]).backward()
    assert all(p.grad is None for p in model.parameters())  # folded into the masters and freed
    for name, m in masters.state_dict().items():
        # the float32 sum of the two bf16 micro-batch gradients, exactly (bf16 -> fp32 is exact, one fp32 add)
        assert torch.equal(m.grad, grads[0][name] + grads[1][name]), name


def test_small_updates_survive_in_the_master(hf_checkpoint):
    # an update of 1e-4 of a weight near 1 is below bf16's resolution (2^-8 = 0.4%): applied to bf16 weights it
    # vanishes, in the float32 master it accumulates until the rounded weight moves
    _, folder = hf_checkpoint("llama")
    model, masters, _ = _setup(folder, torch.bfloat16)
    norm = model.model.norm.weight
    i = masters.names.index("model.norm.weight")
    start = norm.detach().clone()
    lost = start.clone()
    for _ in range(60):
        with torch.no_grad():
            masters.masters[i] += 1e-4
        masters.copy_to_model()
        lost += 1e-4  # the same update on a bf16 copy of the weight
    assert torch.equal(lost, start)  # 1e-4 added to bf16 values near 1 rounds back, 60 times
    assert (norm.float() - start.float()).abs().max() > 3e-3  # 60 x 1e-4 = 6e-3 reached the model


def test_resume_is_bit_exact(hf_checkpoint):
    _, folder = hf_checkpoint("llama", tie_word_embeddings=True)
    model, masters, opt = _setup(folder, torch.bfloat16)
    for _ in range(2):
        _step(model, masters, opt)
    saved = copy.deepcopy({"masters": masters.state_dict(), "optimizer": opt.state_dict()})  # a checkpoint
    for _ in range(2):
        _step(model, masters, opt)

    resumed, resumed_masters, resumed_opt = _setup(folder, torch.bfloat16)
    resumed_masters.load_state_dict(saved["masters"])
    resumed_opt.load_state_dict(saved["optimizer"])
    for _ in range(2):
        _step(resumed, resumed_masters, resumed_opt)
    for (name, a), b in zip(model.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    for name, m in masters.state_dict().items():
        assert torch.equal(m, resumed_masters.state_dict()[name]), name


def test_final_save_is_an_hf_folder(hf_checkpoint, tmp_path):
    import transformers

    _, folder = hf_checkpoint("qwen2")
    model, masters, opt = _setup(folder, torch.bfloat16)
    for _ in range(3):
        _step(model, masters, opt)
    out = save_pretrained(model, tmp_path / "final")
    ours = gapless.load_model(out, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(ours.model.layers[1].mlp.up_proj.weight, model.model.layers[1].mlp.up_proj.weight.float())
        hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        assert_close(hf(IDS).logits, ours(IDS), atol=1e-4, rtol=0)
