import pytest
import torch

from megatron_iso.rl.losses import (
    PolicyLossConfig,
    group_advantages,
    informative_groups,
    k3_kl,
    loss_normaliser,
    overlong_penalty,
    policy_loss,
)
from megatron_iso.settings.correction import RolloutCorrection


def test_group_advantages_are_centred_per_group():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5])
    adv = group_advantages(r, 4)
    assert torch.allclose(adv.view(2, 4).sum(1), torch.zeros(2), atol=1e-6)
    assert adv[0] > 0 > adv[1]
    assert torch.equal(adv[4:], torch.zeros(4))  # equal rewards carry no signal
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(r, 3)


def test_dynamic_sampling_drops_uniform_groups():
    r = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    assert informative_groups(r, 2).tolist() == [False, True, False]


def test_overlong_penalty_ramps_to_the_limit():
    pen = overlong_penalty(torch.tensor([4, 6, 7, 8]), max_len=8, buffer=2)
    assert pen.tolist() == [0.0, 0.0, -0.5, -1.0]


def test_k3_is_zero_iff_equal_and_positive_otherwise():
    a = torch.tensor([-1.0, -2.0])
    assert torch.equal(k3_kl(a, a), torch.zeros(2))
    assert (k3_kl(a, a + 0.3) > 0).all()


def _loss_inputs():
    logp = torch.tensor([-1.0, -0.5, -2.0, -0.1], requires_grad=True)
    old = torch.tensor([-1.0, -1.0, -1.0, -0.1])
    mask = torch.tensor([True, True, True, False])
    seq = torch.tensor([0, 0, 1, 1])
    adv = torch.tensor([1.0, -1.0])
    return logp, old, adv, mask, seq


def test_clip_higher_changes_which_tokens_are_clipped():
    logp, old, adv, mask, seq = _loss_inputs()
    _, sym = policy_loss(logp, old, adv, mask, seq, PolicyLossConfig(clip_low=0.2, clip_high=0.2))
    _, dapo = policy_loss(logp, old, adv, mask, seq, PolicyLossConfig(algo="dapo", clip_low=0.2, clip_high=0.7))
    # ratio exp(0.5)=1.65 is outside [0.8, 1.2] but inside [0.8, 1.7]; exp(-1)=0.37 is outside both.
    assert sym["policy/clip_frac"] == pytest.approx(2 / 3)
    assert dapo["policy/clip_frac"] == pytest.approx(1 / 3)


def test_aggregations_differ_and_loss_has_gradient():
    logp, old, adv, mask, seq = _loss_inputs()
    tok, _ = policy_loss(logp, old, adv, mask, seq, PolicyLossConfig(aggregation="token_mean"))
    seqm, _ = policy_loss(logp, old, adv, mask, seq, PolicyLossConfig(aggregation="seq_mean_token_mean"))
    assert tok.item() != seqm.item()
    tok.backward()
    assert logp.grad is not None and logp.grad[3] == 0  # masked token gets no gradient


def test_truncated_is_reweights_by_trainer_over_rollout_ratio():
    logp, old, adv, mask, seq = _loss_inputs()
    rollout = old - 0.1
    cfg = PolicyLossConfig(correction=RolloutCorrection("truncate", upper=2.0))  # what rl.tis_cap=2.0 was
    _, stats = policy_loss(logp, old, adv, mask, seq, cfg, rollout_logp=rollout)
    assert stats["rollout_correction/weight_mean"] == pytest.approx(float(torch.exp(torch.tensor(0.1))), rel=1e-6)
    with pytest.raises(ValueError, match="rollout logprobs"):
        policy_loss(logp, old, adv, mask, seq, cfg)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"algo": "ppo"}, r"rl.algo='ppo'.*\['grpo', 'dapo'\]"), ({"clip_low": -1}, "rl.clip_low"),
     ({"aggregation": "sum"}, "rl.aggregation")],
)  # fmt: skip
def test_bad_loss_config_names_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PolicyLossConfig(**kwargs)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
@pytest.mark.parametrize(
    "extra",
    [{}, {"kl_coef": 0.1, "correction": RolloutCorrection("truncate", upper=2.0)},
     {"correction": RolloutCorrection("icepop", "geometric", upper=1.2)}],
    ids=["clip", "kl_tis", "icepop_geometric"],
)  # fmt: skip
def test_micro_batch_losses_with_the_step_normaliser_add_up_to_the_step_loss(aggregation, extra):
    """Split by sequence, each part divided by the whole step's normaliser: the parts' losses sum to the
    step's loss and every token's gradient is the one-batch gradient bit for bit (the normaliser is
    the same number, not a mean of micro-batch means)."""
    gen = torch.Generator().manual_seed(0)
    lengths = [5, 0, 3, 8, 1, 4]  # sequence 1 has no response token
    rows = torch.tensor(lengths) + 2
    seq = torch.repeat_interleave(torch.arange(len(lengths)), rows)
    mask = torch.arange(seq.numel()) - (torch.cumsum(rows, 0) - rows)[seq] >= 2  # 2 prompt rows, then the response
    logp = -torch.rand(seq.numel(), generator=gen) * 3
    old = logp + 0.3 * torch.randn(seq.numel(), generator=gen)
    ref, rollout = old - 0.2 * torch.rand(seq.numel(), generator=gen), old - 0.1
    adv = torch.randn(len(lengths), generator=gen)
    cfg = PolicyLossConfig(aggregation=aggregation, **extra)
    norm = loss_normaliser(mask, seq, aggregation)
    assert norm == (float(sum(lengths)) if aggregation == "token_mean" else 5.0)

    def run(rows: slice, first_seq: int, normaliser: float | None) -> tuple[torch.Tensor, torch.Tensor]:
        x = logp[rows].clone().requires_grad_(True)
        n_seqs = int(seq[rows].max()) + 1 - first_seq
        loss, _ = policy_loss(
            x, old[rows], adv[first_seq : first_seq + n_seqs], mask[rows], seq[rows] - first_seq, cfg,
            rollout_logp=rollout[rows], ref_logp=ref[rows], normaliser=normaliser,
        )  # fmt: skip
        loss.backward()
        return loss.detach(), x.grad

    whole, whole_grad = run(slice(None), 0, None)
    cut = int((seq < 3).sum())  # sequences 0-2 | 3-5
    a, grad_a = run(slice(0, cut), 0, norm)
    b, grad_b = run(slice(cut, None), 3, norm)
    assert torch.equal(torch.cat([grad_a, grad_b]).view(torch.int32), whole_grad.view(torch.int32))
    assert torch.allclose(a + b, whole, rtol=1e-6, atol=0)  # the forward sums reassociate
    # Each part's own normaliser (a mean of micro-batch means) is a different gradient.
    own, _ = run(slice(0, cut), 0, None)
    assert not torch.equal(own, a)
    with pytest.raises(ValueError, match="normaliser=0.0 must be > 0"):
        run(slice(None), 0, 0.0)
