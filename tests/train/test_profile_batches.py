"""`fitdqn profile` measures past budget.max_batch while throughput still rises (the pure part, on the CPU)."""

from fitdqn.train.profile import RISE, choose_batch, next_batch_beyond


def rows(*pairs):
    return [{"batch": b, "epoch_samples_per_s": s} for b, s in pairs]


def test_batches_are_doubled_past_the_cap_while_samples_per_second_rise():
    rising = rows((4096, 1.07e6), (8192, 1.26e6), (16384, 1.40e6))  # the shipped h200 profile: still climbing
    assert next_batch_beyond(rising, limit=1 << 20) == 32768
    assert next_batch_beyond(rising, limit=30000) is None  # not past what fits (and what the replay serves)
    flat = rows((8192, 1.26e6), (16384, 1.26e6 * (1 + RISE / 2)))
    assert next_batch_beyond(flat, limit=1 << 20) is None
    failed = [*rising, {"batch": 32768, "error": "out of memory"}]
    assert next_batch_beyond(failed, limit=1 << 20) is None
    assert next_batch_beyond(rows((16384, 1.0e6)), limit=1 << 20) is None  # one row: nothing to compare


def test_the_profile_batch_may_lie_beyond_the_cap_when_it_is_really_faster():
    measured = rows((8192, 1.26e6), (16384, 1.40e6), (32768, 1.60e6), (65536, 1.62e6))
    assert choose_batch(measured) == 32768  # within 5 % of the best, and smallest such
