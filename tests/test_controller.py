"""The runtime controller: one node budget per pass, shared by node value among the rows in flight."""
import torch

from offspec.engine.controller import Controller
from offspec.engine.rounds import RoundRecord, RowView
from offspec.spec.tree import TokenTree


def budget(controller, row):
    """Row's tree budget this round, as the loop asks for it (plan over the rows in flight, here just this one)."""
    return controller.plan([RowView(row)]).budgets[row]


def chain(values):
    """A chain of nodes with the given values (root excluded)."""
    tree = TokenTree(0, capacity=len(values) + 1)
    parent = 0
    for i, v in enumerate(values):
        parent = tree.add(parent, i + 1, v)
    return tree


def wide(values):
    tree = TokenTree(0, capacity=len(values) + 1)
    for i, v in enumerate(values):
        tree.add(0, i + 1, v)
    return tree


def planner_after(trees, passes=((10, 1.0), (40, 1.3), (80, 1.7))):
    p = Controller(start=16, max_budget=64, max_depth=4)
    for row in trees:
        budget(p, row)
    for n, t in passes:                          # three pass sizes: the slope of t_target is known
        p.passes.append((n, t))
    p.explored_low = True
    p.observe(RoundRecord(trees, draft_seconds=0.05, target_seconds=1.0, pass_tokens=40))
    return p


def test_rows_whose_drafts_do_well_get_more_of_the_pass():
    good = wide([0.9 ** k for k in range(1, 17)])          # values 0.9, 0.81, ...: many likely nodes
    poor = wide([0.05 / k for k in range(1, 17)])          # unlikely nodes only
    p = planner_after({"good": good, "poor": poor})
    assert budget(p, "good") > 4 * budget(p, "poor") and budget(p, "poor") >= 1


def test_one_row_is_the_single_sequence_planner():
    """With one row the shared planner picks what minimizes (draft + target seconds) / (1 + sum of values), the
    draft's being a catch-up call (c0 and the root's e) and one growth call a depth (c0 and c1 a node)."""
    values = [0.6 ** k for k in range(1, 17)]      # falling fast: the optimum lies inside the tree
    p = planner_after({"only": wide(values)})
    b = budget(p, "only")
    a, slope = p.target_fit()

    def cost(n):
        c0, c1 = p.draft_fit()
        return (c0 * 2 + c1 * n + p.catch_up_fit() + a + slope * (n + 1)) / (1 + sum(values[:n]))
    assert 1 <= b <= 16 and cost(b) == min(cost(n) for n in range(1, 17))


def test_a_row_at_the_edge_of_its_tree_gets_a_larger_tree_and_finished_rows_are_forgotten():
    sure = chain([0.99 ** k for k in range(1, 5)])        # every node worth taking, depth 4 = max_depth: no deeper
    shallow = wide([0.99] * 4)                            # depth 1 < max_depth: may grow
    p = planner_after({"sure": sure, "shallow": shallow})
    assert budget(p, "shallow") == 8 and budget(p, "sure") == 4
    p.forget("sure")
    assert "sure" not in p.trees and budget(p, "new row") == 16


def plain_decoding_planner():
    """Two rows of weak trees, expensive draft calls and a target pass that costs every extra token (0.1 s a
    token: speculation's nodes are not free): plain decoding wins."""
    weak = {r: wide([0.02] * 8) for r in ("a", "b")}
    p = Controller(start=8, max_budget=64, max_depth=4)
    for row in weak:
        budget(p, row)
    for n, t in ((2, 0.2), (10, 1.0), (18, 1.8)):
        p.passes.append((n, t))
    p.explored_low = True
    p.observe(RoundRecord(weak, draft_seconds=0.5, target_seconds=1.0, pass_tokens=18))
    return p


def test_plain_decoding_when_no_tree_pays_and_trees_come_back_when_they_do():
    """Expensive draft calls and a target pass that costs every extra token: every budget goes to 0 (plain
    decoding, no draft call); when later passes show extra tokens are cheap, the rows' last trees are used again."""
    p = plain_decoding_planner()
    assert budget(p, "a") == budget(p, "b") == 0
    for _ in range(32):                                     # plain passes now; then extra tokens turn out free
        p.observe(RoundRecord({}, draft_seconds=0.0, target_seconds=1.0, pass_tokens=2))
    for n in (40, 80, 120):
        p.observe(RoundRecord({}, draft_seconds=0.0, target_seconds=1.0, pass_tokens=n))
    p.drafts.clear()
    p.drafts.append((1, 1, 1, 1, 0.0))                      # ... and draft calls turn out free
    p.observe(RoundRecord({}, draft_seconds=0.0, target_seconds=1.0, pass_tokens=2))
    assert budget(p, "a") > 0 and budget(p, "b") > 0


def test_plain_decoding_still_times_a_tree_now_and_then():
    """One bad tree measurement (a busy machine, an unlucky round) must not turn trees off for good: while plain
    decoding wins, trees are grown again after 4 plain rounds, then after 8, 16 and at most 32."""
    p = plain_decoding_planner()
    assert budget(p, "a") == 0
    budgets = []
    for _ in range(128):
        budgets.append(budget(p, "a"))
        p.observe(RoundRecord({}, draft_seconds=0.0, target_seconds=0.2, pass_tokens=2))
    probes = [k for k, b in enumerate(budgets) if b > 0]
    assert [b - a for a, b in zip(probes, probes[1:])] == [8, 16, 32, 32, 32] and probes[0] == 3


def test_a_row_joining_while_plain_decoding_wins_decodes_plainly_until_trees_are_timed_again():
    """Its draft need not read its prompt while no tree pays: it starts at 0, is not the probe (its draft is the
    furthest behind), and grows its first tree when trees win again (or first of all, when only such rows are
    left: one of them, the least behind, times a tree for all)."""
    p = plain_decoding_planner()
    assert budget(p, "a") == 0 and budget(p, "new") == 0
    backlog = {"a": 2, "b": 2, "new": 40}
    while budget(p, "a") == 0:                               # plain rounds until the probe
        p.observe(RoundRecord({}, draft_seconds=0.0, target_seconds=0.2, pass_tokens=3, behind=backlog))
    assert budget(p, "new") == 0
    p.passes.clear()
    p.passes.extend([(2, 1.0), (40, 1.0), (80, 1.0)])      # extra tokens and draft calls turn out free:
    p.drafts.clear()                                        # trees win again
    p.drafts.extend([(1, 1, 1, 1, 0.0), (2, 4, 2, 3, 0.0), (3, 9, 3, 6, 0.0)])
    p.observe(RoundRecord({}, draft_seconds=0.0, target_seconds=1.0, pass_tokens=2))
    # "new" grows its first tree, of a row's share of the best nodes: the two known rows' 16 nodes all pay
    assert budget(p, "a") > 0 and budget(p, "new") == 8
    p = Controller(start=8, max_budget=64)
    p.plain_wins = True                                     # plain decoding won, then its rows finished
    budget(p, "late")
    budget(p, "later")
    p.passes.append((2, 0.2))
    p.drafts.append((1, 1, 1, 1, 0.1))
    p.observe(RoundRecord({}, draft_seconds=0.0, target_seconds=0.2, pass_tokens=1, behind={"late": 30, "later": 12}))
    assert budget(p, "late") == 0 and budget(p, "later") == 8


def test_a_probe_grows_one_tree_the_row_whose_draft_is_least_behind():
    """While plain decoding wins, the probe that re-times trees pays a catch-up for every row it grows: it grows
    one, the cheapest to catch up."""
    p = plain_decoding_planner()
    budgets = (0, 0)
    while budgets == (0, 0):
        p.observe(RoundRecord({}, draft_seconds=0.0, target_seconds=0.2, pass_tokens=2, behind={"a": 9, "b": 3}))
        budgets = (budget(p, "a"), budget(p, "b"))
    assert budgets[0] == 0 and budgets[1] > 0


def test_no_probe_while_the_drafts_backlog_alone_costs_more_than_plain_decoding():
    """A probe only matters if trees can come back, and going back pays every row's draft backlog over the tokens
    the rows have left (_switch_cost). Once that alone costs more a token than plain decoding (the job's tail, or
    rows whose drafts never read their prompts), no tree can pay for the switch: the probe waits, and its catch-up
    is never spent. Here plain decoding costs 0.1 s a token and a catch-up token 0.01 s (the draft's measured
    c1): 100 tokens of backlog a row over 200 tokens left is 0.005 s a token and probes go on; over 5, 0.2 s."""
    def probed(left):
        p = plain_decoding_planner()
        p.catch_ups.append((100, 1.0))
        budgets = []
        for _ in range(40):
            p.observe(RoundRecord({}, draft_seconds=0.0, target_seconds=0.2, pass_tokens=2, behind={"a": 101, "b": 101},
                      left={"a": left, "b": left}))
            budgets.append(budget(p, "a") + budget(p, "b"))
        return sum(b > 0 for b in budgets)
    assert probed(left=200) >= 2
    assert probed(left=5) == 0


def two_rows(node_seconds: float = 0.01, plain_wins: bool = False) -> Controller:
    """A planner of rows "a" and "b" that has measured: a pass costs 1 s whatever its size, a draft call nothing
    (c0 = 0) and each node it runs on `node_seconds` (c1; nothing dropped: as many nodes kept as run on), a
    catch-up token as much (e); pass sizes already explored."""
    p = Controller(start=8, max_budget=64, max_depth=4)
    for row in ("a", "b"):
        budget(p, row)
    p.explored_low, p.plain_wins = True, plain_wins
    p.passes.extend([(2, 1.0), (10, 1.0), (18, 1.0)])
    per_100 = 100 * node_seconds
    p.drafts.extend([(1, 0, 1, 0, 0.0), (1, 100, 1, 100, per_100), (2, 100, 2, 100, per_100)])
    p.catch_ups.append((100, per_100))
    return p


def switching_planner(behind: int, left: int):
    """Plain decoding won; now the rows' trees are 10% cheaper a token than plain decoding, before the drafts'
    backlog (`behind` tokens a row, e = 0.01 s a token) is counted; `left`: tokens a row may still generate."""
    p = two_rows(plain_wins=True)
    trees = {r: chain([0.6, 0.2]) for r in ("a", "b")}
    # best tree: N = 2 (one 0.6 node a row): (0.01 N + 0.01 R + 1) / (2 + 1.2) = 0.325 s a token; plain: 0.5 s
    p.observe(RoundRecord(trees, draft_seconds=0.0, target_seconds=1.0, pass_tokens=2, timed=False,
              behind={"a": behind, "b": behind}, left={"a": left, "b": left}))
    return p


def test_going_back_to_trees_pays_the_drafts_backlog_over_the_tokens_left():
    """Trees save 0.175 s a token; a backlog of 401 tokens a row costs 0.01 s each: 8 s, worth it over 100
    tokens a row (0.04 s a token) and not over 10 (0.4 s a token)."""
    assert budget(switching_planner(behind=401, left=100), "a") > 0
    assert budget(switching_planner(behind=401, left=10), "a") == 0
    assert budget(switching_planner(behind=1, left=1), "a") > 0       # no backlog: only the per-round cost


def test_going_back_to_trees_wants_them_clearly_cheaper():
    """Near a tie, switching between plain decoding and trees costs more (backlog reads, probes) than the trees
    return: trees predicted 5% cheaper a token keep trees that are running, but do not end plain decoding; 23%
    cheaper do."""
    def choice(value, plain_wins):
        p = two_rows(node_seconds=0.0, plain_wins=plain_wins)   # free draft work
        # plain: 1 s for 2 tokens; trees: 1 s for 2 + 2 value tokens
        p.observe(RoundRecord({r: chain([value]) for r in ("a", "b")}, draft_seconds=0.0, target_seconds=1.0, pass_tokens=4,
                  timed=False))
        return budget(p, "a") > 0
    assert choice(0.05, plain_wins=False) and not choice(0.05, plain_wins=True)
    assert choice(0.3, plain_wins=False) and choice(0.3, plain_wins=True)


def test_kept_nodes_are_priced_by_the_draft_work_they_took_and_catch_ups_by_their_own():
    """Growth runs the draft on more working-tree nodes than it keeps, and calls to its working tree's depth:
    the fit is per call and per node run, and a budget of N kept nodes is priced by the measured ratios (here
    3 nodes run and 1.5 calls per node and level kept). A catch-up call, which feeds tokens without tree work,
    is priced by its own seconds a token and leaves the growth fit alone."""
    p = Controller()
    p.passes.append((2, 0.2))
    for depth, width in ((4, 1), (2, 3), (4, 2)):
        tree = TokenTree(0, capacity=depth * width + 1)
        for _ in range(width):
            parent = 0
            for k in range(depth):
                parent = tree.add(parent, k + 1, 0.5)
        calls, nodes = depth * 3 // 2, 3 * depth * width
        budget(p, "r")
        p.observe(RoundRecord({"r": tree}, draft_seconds=0.01 * calls + 0.002 * nodes, target_seconds=0.2, pass_tokens=5,
                  draft_calls=calls, draft_nodes=nodes))
    c0, c1 = p.draft_fit()
    assert abs(c0 - 0.01) < 1e-9 and abs(c1 - 0.002) < 1e-9
    assert p.working_ratios() == (1.5, 3.0)
    assert abs(p.catch_up_fit() - c1) < 1e-12          # no catch-up seen yet: a draft forward row's cost
    p.observe(RoundRecord({}, draft_seconds=0.0, target_seconds=0.2, pass_tokens=2, catch_up=(200, 0.1)))
    p.observe(RoundRecord({}, draft_seconds=0.0, target_seconds=0.2, pass_tokens=2, catch_up=(50, 0.05)))
    assert torch.allclose(torch.tensor(p.draft_fit()), torch.tensor((c0, c1)))
    assert abs(p.catch_up_fit() - 0.15 / 250) < 1e-12


def test_tree_rounds_that_yield_less_than_predicted_count_against_trees():
    """Each round in which every row grew a tree is checked against the model: its measured seconds per token
    over the model's prediction for the trees it grew scales the trees' predicted cost. Rows whose trees, by the
    model, beat plain decoding (0.33 against 0.5 s a token) decode plainly once a round showed the model 1.8x
    too hopeful, and keep their trees when it was right."""
    def after_a_round(yielded):
        p = two_rows()                                            # c1 = e = 0.01 s
        trees = {r: chain([0.6, 0.2]) for r in ("a", "b")}
        # the model: 1 + 0.01 (4 nodes) + 0.01 (2 roots) = 1.06 s for 2 + 1.6 tokens; measured: 1.06 s, `yielded`
        p.observe(RoundRecord(trees, draft_seconds=0.04, target_seconds=1.0, pass_tokens=6, draft_calls=2, draft_nodes=4,
                  catch_up=(2, 0.02), yielded=yielded))
        return p
    hopeful, right = after_a_round(yielded=2), after_a_round(yielded=4)
    assert abs(hopeful.miss() - 1.8) < 1e-9 and abs(right.miss() - 0.9) < 1e-9
    assert budget(hopeful, "a") == 0 and budget(right, "a") > 0


def test_a_catch_up_that_read_a_backlog_counts_one_token_a_row_against_the_trees():
    """The first tree round after plain rounds feeds the drafts' backlogs (40 tokens for 2 rows, 0.4 s): checked
    against the model with its catch-up counted as one token a row; the rest of that read is the switch's cost,
    charged apart (_switch_cost), not a tree's. A round where only some rows grew a tree is not checked: one row's
    tree among plain rows says little of what every row's would do. A row left no tree by its last token (capped)
    is not plain decoding: its round is checked, the row's one token counted as the model counts it."""
    def after_a_round(trees, catch_up, yielded=2, capped=frozenset()):
        p = two_rows()                                            # c1 = e = 0.01 s
        # the model: 1 + 0.01 (nodes) + 0.01 (2 roots) s for 2 + the values' tokens
        nodes = sum(t.size for t in trees.values())
        p.observe(RoundRecord(trees, draft_seconds=0.01 * nodes, target_seconds=1.0, pass_tokens=2 + nodes, draft_calls=2,
                  draft_nodes=nodes, catch_up=catch_up, yielded=yielded, capped=capped))
        return p
    both = {r: chain([0.6, 0.2]) for r in ("a", "b")}
    # 1.06 s for 3.6 tokens predicted; 1.06 s measured once 38 of the 40 tokens are taken out at e = 0.01
    assert abs(after_a_round(both, catch_up=(40, 0.4)).miss() - 1.8) < 1e-9
    assert abs(after_a_round(both, catch_up=(2, 0.02)).miss() - 1.8) < 1e-9
    one_tree = {"a": chain([0.6, 0.2]), "b": TokenTree.root_only(0)}
    assert not after_a_round(one_tree, catch_up=(2, 0.02)).misses
    # b's last token: 1 + 0.02 (2 nodes) + 0.02 (2 roots) = 1.04 s predicted for 2 + 0.8 tokens, 1.04 s measured
    # for 2 tokens: miss = 2.8 / 2
    last = after_a_round(one_tree, catch_up=(2, 0.02), capped=frozenset({"b"}))
    assert len(last.misses) == 1 and abs(last.miss() - 1.4) < 1e-9


def test_the_miss_ratio_weighs_lucky_and_unlucky_rounds_alike():
    """Two rounds the model priced right on average (2.5 tokens expected, 1 and 4 yielded, seconds as predicted):
    the ratio of sums says 1. A median or mean of per-round ratios (2.5 and 0.625) would say 1.56 and keep trees
    off where they pay."""
    p = Controller()
    p.misses.extend([(1.0, 1, 1.0, 2.5), (1.0, 4, 1.0, 2.5)])
    assert abs(p.miss() - 1.0) < 1e-12


def test_a_compute_bound_draft_gets_narrower_trees():
    """t_draft = c0 per call + c1 per node kept: where a draft call costs by its rows (a CPU), low-value side
    nodes cost more than they return and the tree shrinks to its likely spine; where it costs by the call (a
    GPU), the same nodes are worth verifying."""
    def tree():
        t = TokenTree(0, capacity=30)
        parent = 0
        for k in range(1, 9):                          # a likely spine ...
            parent = t.add(parent, k, 0.8 ** k)
        for k in range(16):                            # ... and unlikely alternatives at the root
            t.add(0, 100 + k, 0.1)
        return t

    budgets = {}
    for name, per_node in (("latency-bound", 0.0), ("compute-bound", 0.1)):
        p = planner_after({"r": tree()})
        p.drafts.clear()
        for calls, nodes in ((4, 4), (4, 40), (8, 16), (6, 30)):
            p.drafts.append((calls, nodes, calls, nodes, 0.01 * calls + per_node * nodes))
        c0, c1 = p.draft_fit()
        assert abs(c0 - 0.01) < 1e-9 and abs(c1 - per_node) < 1e-9
        p.observe(RoundRecord({"r": tree()}, draft_seconds=0.0, target_seconds=1.0, pass_tokens=40, timed=False))
        budgets[name] = budget(p, "r")
    assert budgets["compute-bound"] <= 8 < budgets["latency-bound"]


def planner_costing(a, b, c0=0.01, c1=0.0, tree=lambda: chain([0.8 ** k for k in range(1, 9)]), rows=4):
    """A planner whose fits are exactly t_target(n) = a + b n and t_draft = c0 per call + c1 per node (catch-up
    tokens: c1 too, none having been timed)."""
    trees = {r: tree() for r in range(rows)}
    p = Controller(start=16, max_budget=1024, max_depth=32)
    for r in trees:
        budget(p, r)
    for n in (8, 40, 80):
        p.passes.append((n, a + b * n))
    for calls, nodes in ((4, 4), (4, 40), (8, 16), (6, 30)):
        p.drafts.append((calls, nodes, calls, nodes, c0 * calls + c1 * nodes))
    p.explored_low = True
    p.observe(RoundRecord(trees, draft_seconds=0.0, target_seconds=0.0, pass_tokens=40, timed=False))
    return p


def test_auto_concurrency_takes_every_row_while_the_pass_is_its_fixed_cost():
    """Streaming: a pass costs its bytes (a = 5 s) whatever it computes, so every row the plan holds adds tokens."""
    assert planner_costing(a=5.0, b=1e-4).rows_worth(16) == 16


def test_auto_concurrency_stops_where_rows_no_longer_add_tokens_per_second():
    """A pass that is compute (b large against a): past a few rows each one adds its tokens and their cost, so
    tokens/s stays flat and fewer rows give the same throughput with less wait per prompt."""
    fixed, compute = planner_costing(a=0.2, b=0.002), planner_costing(a=0.02, b=0.02)
    assert 1 <= compute.rows_worth(16) < fixed.rows_worth(16) <= 16
    assert compute.rows_worth(16) == rows_by_hand(compute, most=16)


def rows_by_hand(p: Controller, most: int) -> int:
    """rows_worth written out for rows of equal chains: the fewest rows within ROW_GAIN of the best rate, a rate
    being the best over k pooled nodes (k = 0: plain decoding) of tokens over seconds, the trees' seconds the
    model's times the measured miss, their draft priced per node where more rows than measured are extrapolated
    and the fit cannot tell a call from a node."""
    from offspec.engine.controller import ROW_GAIN
    R = len(p.trees)
    a, b = p.target_fit()
    e = p.catch_up_fit()
    values = sorted((float(v) for r in p.trees for v in p.trees[r].values[1:]), reverse=True)

    def rate(n_rows):
        m, best = n_rows / R, n_rows / (a + b * n_rows)                 # k = 0: plain decoding
        c0, c1 = p.draft_fit("per node" if m > 1 else "per call")
        for k in range(1, len(values) + 1):
            depth = (k + R - 1) // R            # the pooled best k nodes of R equal chains reach this depth
            N = m * k
            seconds = (c0 * (depth + 1) + c1 * N + e * n_rows + a + b * (N + n_rows)) * p.miss()
            best = max(best, (n_rows + m * sum(values[:k])) / seconds)
        return best
    rates = [rate(n) for n in range(1, most + 1)]
    return next(n for n, r in enumerate(rates, 1) if r >= (1 - ROW_GAIN) * max(rates))


def test_auto_concurrency_prices_trees_as_the_budget_choice_does():
    """Rows added beyond those measured are priced like the budget choice's rows without a tree: the measured
    miss scales the trees' seconds, and a draft fit from one growth round (a call's cost and a node's not told
    apart) is taken per node for more rows, per call for fewer. Per call, 16 rows' trees would cost the draft
    what 2 rows' did, which made every row look worth its place."""
    trees = {r: chain([0.8 ** k for k in range(1, 9)]) for r in range(2)}
    p = Controller(start=16, max_budget=1024, max_depth=32)
    for r in trees:
        budget(p, r)
    for n in (8, 40, 80):                        # a pass: 1 s and 2 ms a token
        p.passes.append((n, 1.0 + 0.002 * n))
    p.drafts.append((8, 16, 8, 16, 0.32))         # one growth round: 20 ms a node, or 40 ms a call
    p.explored_low = True
    p.observe(RoundRecord(trees, draft_seconds=0.0, target_seconds=0.0, pass_tokens=40, timed=False))
    assert p.draft_fit() == (0.04, 0.0) and p.draft_fit("per node") == (0.0, 0.02)
    assert p.rows_worth(16) == rows_by_hand(p, 16) == 15
    per_call = p.round_seconds
    p.tree_seconds = lambda N, depth, R, m=1.0: per_call(N, depth, R)      # the pricing before: 16 rows
    assert p.rows_worth(16) == 16
    del p.tree_seconds

    p.misses.extend([(3.0, 4, 1.0, 4.0)] * 8)                      # tree rounds measured 3x the model's seconds
    assert p.miss() == 3.0
    # trees now lose to plain decoding, whose tokens/s grows with every row a 1 s pass carries (15 without the miss)
    assert p.rows_worth(16) == rows_by_hand(p, 16) == 16


def test_auto_concurrency_waits_for_measurements():
    p = Controller(start=16, max_budget=64)
    budget(p, "r")
    assert p.rows_worth(8) is None


def test_one_pass_verifies_at_most_max_budget_nodes_over_all_rows():
    """The auto budget is one budget per pass shared by the rows (the memory plan counts logits for max_budget
    nodes in all, plus a node and a root a row): new rows take what is left, and rows that would all grow
    are scaled back to it."""
    p = Controller(start=32, max_budget=64, max_depth=32)
    assert [budget(p, r) for r in range(4)] == [32, 32, 1, 1]
    sure = {r: chain([0.99 ** k for k in range(1, 11)]) for r in range(4)}   # every row takes all its 10 ...
    p = planner_after(sure)
    p.max_depth = 64                                            # ... and, with room to grow, asks for 20
    p.observe(RoundRecord(sure, draft_seconds=0.05, target_seconds=1.0, pass_tokens=40, timed=False))
    assert [budget(p, r) for r in sure] == [16] * 4              # 64 nodes in all


def test_held_resident_layers_add_their_dequantization_to_the_predicted_pass():
    """--resident-quant: fewer bytes stream, and each held layer's dequantization (in line with compute) is added."""
    from offspec.plan.costmodel import GpuSetup, predict_seconds_per_token
    setup = GpuSetup(link_gb_per_s=24.0, dequant_s_per_layer=1e-3)
    plain = predict_seconds_per_token(48 * 10**9, setup, tokens_per_pass=8, draft_seconds_per_round=0.0)
    held = predict_seconds_per_token(24 * 10**9, setup, tokens_per_pass=8, draft_seconds_per_round=0.0, held_layers=50)
    assert plain["pass_seconds"] == 2.0 and abs(held["pass_seconds"] - (1.0 + 0.05)) < 1e-12


def probe_first_job(draft_seconds_a_node: float, rows: int = 16, untimed=(0,), p=None, names=None, rounds=9
                    ) -> tuple[Controller, list[dict]]:
    """A job of `rows` rows started with probe_first: a prefill round, then rounds in which each row grows the
    tree its budget allows (a chain of likely nodes: values 0.8, 0.64, ...), on a machine where a pass costs
    1 s plus 1 ms a token and a draft call 10 ms plus `draft_seconds_a_node` a node it runs on. -> the planner
    and every round's budgets. untimed: the rounds that prefilled (not timed); p, names: go on with this
    planner and these rows."""
    p = p or Controller(start=2, max_budget=256, max_depth=32, probe_first=32)
    names = names or [f"r{i}" for i in range(rows)]
    history = []
    for round_ in range(rounds):
        budgets = {r: budget(p, r) for r in names}
        history.append(budgets)
        trees = {r: chain([0.8 ** k for k in range(1, min(b, 32) + 1)]) if b else TokenTree.root_only(0)
                 for r, b in budgets.items()}
        nodes = sum(t.size for t in trees.values())
        depth = max(t.depth for t in trees.values())
        p.observe(RoundRecord(trees, draft_seconds=depth * 0.01 + nodes * draft_seconds_a_node,
                  target_seconds=1.0 + 0.001 * (nodes + rows), pass_tokens=nodes + rows, timed=round_ not in untimed,
                  catch_up=(nodes and 40, 0.01), behind={r: 1 if budgets[r] else 40 for r in names},
                  left={r: 100 for r in names}, yielded=0))
    return p, history


def test_probe_first_times_one_rows_tree_before_any_other_draft_reads_its_prompt():
    """On a CPU the job's first round prefills its prompts with no tree (one grown there is not timed: its draft
    work would buy its values alone), the next decodes plainly (its pass, timed, sizes the probe); then one row's
    32-node tree, the least behind, while the others' budgets stay 0 (their drafts read nothing) and the probe is
    timed (32 nodes, then 8 for the pass's slope). Then the rows without a tree are priced as copies of the
    probe's: where a pass is a fixed second and draft nodes are cheap, trees pay, and they spread to the other
    rows doubling the rows with one each round (2, 4, 8, 16), each step timed before the next, until every row
    grows a tree."""
    p, history = probe_first_job(draft_seconds_a_node=1e-4)
    assert all(b == 0 for h in history[:2] for b in h.values())
    assert [h["r0"] for h in history[2:4]] == [32, 8]
    assert all(b == 0 for h in history[:4] for r, b in h.items() if r != "r0")
    assert [sum(b > 0 for b in h.values()) for h in history[4:]] == [2, 4, 8, 16, 16]
    assert all(sum(h.values()) <= 256 + 16 for h in history)


def test_trees_spread_to_more_rows_only_after_a_timed_round():
    """A round that prefilled a prompt is not timed: the step to twice the rows with a tree waits for one that is."""
    _, history = probe_first_job(draft_seconds_a_node=1e-4, untimed=(0, 4, 5))
    assert [sum(b > 0 for b in h.values()) for h in history[4:]] == [2, 2, 2, 4, 8]


def test_a_fresh_wave_of_rows_is_decided_from_the_finished_rows_trees():
    """Once the rows that grew trees have finished, their last trees stand for the rows that join after them:
    where plain decoding won, the new rows decode plainly from the start (no new probe tree, their drafts read
    nothing) until the next scheduled probe; where trees won, they grow trees at once, as before."""
    dear, _ = probe_first_job(draft_seconds_a_node=0.05)
    cheap, _ = probe_first_job(draft_seconds_a_node=1e-4)
    for p in (dear, cheap):
        for i in range(16):
            p.forget(f"r{i}")
        assert len(p.past) == (1 if p is dear else 16)
    fresh = [f"n{i}" for i in range(16)]
    _, history = probe_first_job(draft_seconds_a_node=0.05, p=dear, names=fresh, rounds=5)
    assert all(b == 0 for h in history for b in h.values())
    _, history = probe_first_job(draft_seconds_a_node=1e-4, p=cheap, names=fresh, rounds=2)
    assert all(b > 0 for h in history for b in h.values())


def test_probe_first_keeps_plain_decoding_where_the_probes_draft_nodes_are_dear():
    """The same job where a draft node costs 50 ms: 16 rows' trees would cost far more than the one shared pass
    they save, so the others never grow one (their prompts are never read into the draft). The probe's rounds
    cannot tell the draft's cost a call from its cost a node (a chain: calls = nodes), so the other rows' draft
    work is priced per node, its dearest reading; priced per call, 16 trees would look as cheap as one."""
    p, history = probe_first_job(draft_seconds_a_node=0.05)
    assert all(b == 0 for h in history for r, b in h.items() if r != "r0")
    assert p.plain_wins




def test_a_rounding_residual_never_picks_the_draft_model(monkeypatch):
    """Draft rounds that cost exactly c0 a call: the fit's per-node cost is 0 up to rounding, whose sign (which may
    vary with how the solver runs) must not switch the model to per node."""
    p = planner_costing(a=5.0, b=1e-4)
    real = torch.linalg.lstsq

    def residual(sign):
        def lstsq(A, B):
            out = real(A, B)
            return type("Solution", (), {"solution": torch.tensor([[out.solution[0, 0]], [sign * 1e-19]],
                                                                    dtype=torch.float64)})
        return lstsq
    fits = []
    for sign in (1, -1):
        monkeypatch.setattr(torch.linalg, "lstsq", residual(sign))
        fits.append(p.draft_fit("per node"))
    # the same model either way: per call, c0 = 0.01 up to the solver's rounding (which may differ between calls)
    assert all(abs(c0 - 0.01) < 1e-12 and c1 == 0.0 for c0, c1 in fits)
    assert p.rows_worth(16) == 16


def test_a_row_alone_on_a_cpu_with_the_target_resident_prefills_plainly_then_grows_its_tree():
    """Its first token comes after the target's prefill alone: the first round grows no tree, the next decodes
    plainly (timed), the third grows its 32-node tree. Where a pass over many tokens is dear (compute: its cost
    grows with every token, as on a CPU whose wide matmuls are slow), that first tree is cut to what costs at
    most PROBE_PASSES plain passes. Where the pass streams or runs on a GPU, the first round grows the tree with
    the prefill (on a CPU a fixed 16 nodes: the next test)."""
    from offspec.engine.controller import PROBE_PASSES
    from offspec.engine.rounds import RunStart
    def first_tree(a: float, b: float) -> int:
        """A pass costs a + b n over n tokens: the prefill's 40, then a plain pass's 1."""
        cpu = Controller.for_run(RunStart(gpu=False, streamed=False, rows=1, max_budget=1024))
        assert budget(cpu, "r") == 0
        for tokens, timed in ((40, False), (1, True)):
            cpu.observe(RoundRecord({"r": TokenTree(0, capacity=1)}, draft_seconds=0.0, target_seconds=a + b * tokens,
                                    pass_tokens=tokens, timed=timed, catch_up=(0, 0.0)))
            if not timed:
                assert budget(cpu, "r") == 0
        return budget(cpu, "r")
    assert first_tree(0.4, 0.0025) == 32
    a, b = 0.01, 0.0097
    n = first_tree(a, b)
    assert a + b * (1 + n) <= PROBE_PASSES * (a + b) < a + b * (2 + n) and n == 6
    for gpu, streamed, start in ((True, False, 128), (False, True, 16)):
        assert budget(Controller.for_run(RunStart(gpu=gpu, streamed=streamed, rows=1, max_budget=1024)), "r") == start


def test_the_small_exploring_tree_does_not_replace_the_rows_reference():
    """The one small tree that times the target's slope says nothing of the nodes beyond it: the row's reference
    stays its full tree (32 nodes, every one worth taking), so its next budget looks further than that tree (64),
    not twice the small one (16)."""
    p = Controller(start=32, max_budget=128, max_depth=40)
    assert budget(p, "r") == 32
    sure = [0.99 ** k for k in range(1, 33)]
    p.observe(RoundRecord({"r": chain(sure)}, draft_seconds=0.6, target_seconds=1.3, pass_tokens=33))
    assert budget(p, "r") == 8                                  # the exploring tree: a quarter
    p.observe(RoundRecord({"r": chain(sure[:8])}, draft_seconds=0.15, target_seconds=1.1, pass_tokens=9))
    assert p.trees["r"].size == 32 and budget(p, "r") == 64


def test_a_tree_held_shallow_by_the_last_tokens_does_not_replace_the_rows_reference():
    """Near its end a row's tree is cut to the tokens it has left: that tree is counted for the round, but the row's
    reference (and, once it finished, a fresh wave's) stays the full tree before it."""
    p = planner_after({"r": chain([0.9 ** k for k in range(1, 5)])})
    full = p.trees["r"]
    budget(p, "r")
    p.observe(RoundRecord({"r": chain([0.9])}, draft_seconds=0.05, target_seconds=1.0, pass_tokens=2,
                          capped=frozenset({"r"}), finished=("r",)))
    assert list(p.past) == [full]


def test_one_row_on_a_cpu_whose_target_streams_grows_a_fixed_tree():
    """There every round's tree is 16 nodes, whatever the rounds measured; two rows, or a GPU, choose theirs."""
    from offspec.engine.rounds import RunStart

    p = Controller.for_run(RunStart(gpu=False, streamed=True, rows=1, max_budget=1024))
    for n, seconds in ((17, 0.6), (9, 0.5), (33, 0.8), (5, 0.45)):
        assert budget(p, "r") == 16
        p.observe(RoundRecord({"r": chain([0.99] * (n - 1))}, draft_seconds=0.05 * n, target_seconds=seconds,
                              pass_tokens=n))
    assert budget(p, "r") == 16 and len(p.passes) == 4           # the fits are still kept
    for start in (RunStart(gpu=False, streamed=True, rows=2, max_budget=1024),
                  RunStart(gpu=True, streamed=True, rows=1, max_budget=1024)):
        assert not Controller.for_run(start).fixed


def test_a_row_is_held_shallow_only_where_its_last_tokens_bind():
    """RoundRecord.capped: a tree cut by the row's last tokens (its trees then say little of its next ones), not one
    whose budget or depth bound is shallower than what the tokens left allow (an auto depth bound is 1024)."""
    from offspec.config import TreeConfig
    from offspec.engine.request import GenerationRequest
    from offspec.engine.rows import Row, StopChecker

    def row(max_new_tokens, budget, max_depth):
        request = GenerationRequest(prompt_ids=(1,), max_new_tokens=max_new_tokens,
                                    tree=TreeConfig(policy="sequoia", max_depth=max_depth))
        r = Row(index=0, request=request, cache_row=0, seq=[1], stops=StopChecker(None, (), (), max_new_tokens),
                seed_gen=torch.Generator(), speculative=True, auto=True, budget=budget)
        r.start_round(budget, max_context=4096, device=torch.device("cpu"))
        return r.held_shallow()

    assert not row(200, budget=64, max_depth=1024)     # 199 levels allowed, a 64-node tree needs at most 64
    assert row(40, budget=64, max_depth=1024)          # 39 levels, the tree could have reached 64
    assert not row(40, budget=64, max_depth=32)        # its bound was below the tokens left
    assert row(20, budget=64, max_depth=32)
