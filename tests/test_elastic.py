"""hvd.elastic at a fixed size: a script written for Horovod's elastic mode, at any rank count."""
import pytest

torch = pytest.importorskip("torch")

import pycoll.torch as hvd  # noqa: E402

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]


@pytest.fixture(scope="module", autouse=True)
def started():
    hvd.init()


def rank_model(r):
    torch.manual_seed(r)
    return torch.nn.Linear(3, 2)


def params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_run_syncs_every_rank_to_rank_0_and_calls_once():
    r, n = hvd.rank(), hvd.size()
    model = rank_model(r)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()                                   # momentum buffers, per rank
    state = hvd.elastic.TorchState(model, optimizer, epoch=r, note=f"rank {r}")
    calls = []

    @hvd.elastic.run
    def train(state, extra):
        calls.append(extra)
        return state.epoch, state.note, params(state.model)

    epoch, note, flat = train(state, "x")
    assert calls == ["x"] and (epoch, note) == (0, "rank 0")
    assert torch.equal(flat, params(rank_model(0)) - 0.1)       # rank 0's step: grads of 1
    momentum = optimizer.state_dict()["state"][0]["momentum_buffer"]
    assert torch.equal(hvd.broadcast(momentum, root_rank=0), momentum)


def test_commit_and_restore():
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = hvd.elastic.TorchState(model, optimizer, batch=0)
    state.batch = 5
    state.commit()
    saved = params(model).clone()
    with torch.no_grad():
        model.weight.add_(1.0)
    state.batch = 9
    state.restore()
    assert state.batch == 5 and torch.equal(params(model), saved)
    replacement = torch.nn.Linear(2, 2)
    state.model = replacement                       # a new model is the one saved
    with torch.no_grad():
        replacement.bias.fill_(7.0)
    state.restore()
    assert state.model is replacement and not torch.equal(replacement.bias, torch.full((2,), 7.0))


def test_internal_errors_end_the_call_and_callbacks_never_run():
    state = hvd.elastic.TorchState(epoch=0)
    reset = []
    state.register_reset_callbacks([lambda: reset.append(1)])
    calls = []

    @hvd.elastic.run
    def train(state):
        calls.append(1)
        raise hvd.HorovodInternalError("lost a rank")

    with pytest.raises(hvd.HorovodInternalError, match="lost a rank"):
        train(state)
    assert calls == [1] and reset == []


def test_sampler_partitions_and_resumes_where_the_epoch_stopped():
    r, n = hvd.rank(), hvd.size()
    data = list(range(23))
    sampler = hvd.elastic.ElasticSampler(data, shuffle=True, seed=3)
    first = list(sampler)
    everyone = hvd.allgather_object(first)
    assert all(len(part) == len(first) == -(-23 // n) for part in everyone)
    assert set().union(*everyone) == set(data)
    sampler.record_batch(0, 2)                          # two samples on every rank done
    state = hvd.elastic.TorchState(sampler=sampler)
    state.commit()
    sampler.set_epoch(1)
    assert list(sampler) != first                       # a new order each epoch
    state.restore()                                     # epoch 0, the rest of it
    assert sampler.state_dict() == {"epoch": 0, "processed_num": 2 * n}
    rest = list(sampler)
    assert len(rest) == -(-(23 - 2 * n) // n)
    done = {i for part in everyone for i in part[:2]}
    assert set().union(*hvd.allgather_object(rest)) == set(data) - done


def test_a_horovod_elastic_training_loop():
    r, n = hvd.rank(), hvd.size()
    data = torch.utils.data.TensorDataset(torch.randn(40, 3, generator=torch.Generator()
                                                      .manual_seed(1)), torch.randn(40, 2))
    model = rank_model(r)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                         named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(data, shuffle=False)
    loader = torch.utils.data.DataLoader(data, batch_size=4, sampler=sampler)
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0)

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, 2):
            for i, (x, y) in enumerate(loader):
                optimizer.zero_grad()
                torch.nn.functional.mse_loss(state.model(x), y).backward()
                optimizer.step()
                state.sampler.record_batch(i, 4)
                state.commit()
            state.sampler.set_epoch(state.epoch + 1)
        return params(state.model)

    flat = train(state)
    assert torch.equal(hvd.broadcast(flat, root_rank=0), flat)       # replicas alike
    assert state.epoch == 1 and sampler.epoch == 2
