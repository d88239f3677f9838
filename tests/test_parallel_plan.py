import pytest

from dsv4c.parallel import ParallelPlan, PlanError


def test_mesh_coordinates_and_groups():
    plan = ParallelPlan(tp=2, ep=3)
    assert plan.world_size == 6
    assert [plan.coords(r) for r in range(6)] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert plan.tp_group(3) == (2, 3)
    assert plan.ep_group(3) == (1, 3, 5)
    assert ParallelPlan.from_dict(plan.to_dict()) == plan
    assert "tp=2" in str(plan)


@pytest.mark.parametrize("kw,field", [({"tp": 0}, "tp"), ({"ep": -1}, "ep"), ({"tp": 1.5}, "tp")])
def test_bad_plans_name_the_field(kw, field):
    with pytest.raises(PlanError) as e:
        ParallelPlan(**kw)
    assert e.value.field == field


def test_rank_outside_world_and_inconsistent_dict():
    with pytest.raises(PlanError, match="rank"):
        ParallelPlan(tp=2).coords(2)
    with pytest.raises(PlanError, match="world_size"):
        ParallelPlan.from_dict({"tp": 2, "ep": 2, "world_size": 2})
