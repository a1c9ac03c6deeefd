//! Speculation gated by load: the draft depth that maximises a target's aggregate throughput at
//! its current batch, from measured pass times per row count and the measured acceptance.
//!
//! A pass of `B` sessions each verifying a draft chain of depth `d` runs `B·(d+1)` rows and
//! yields `B·E(d)` tokens in expectation, `E(d) = 1 + α + … + α^d` with α the per-token
//! acceptance. Between two of its passes a session spends `G(d)` away from the target: its
//! orchestrator drafts the next chain (and waits for a draft worker the other sessions share)
//! and sends it. [`LoadGate::advise`] picks the `d` in `0..=max` that maximises
//! `B·E(d) / (T(B·(d+1)) + G(d))`, `T` the pass time the gate has measured at that row count
//! (in rounds that continue a sequence: a new prompt's round spends its time on the prompt's
//! prefill too; where the model runs a pass's sessions in groups of limited rows, a round past
//! that limit is priced as a pass a group) and `G` the gap it has measured after answers at that
//! depth. Where `T` is flat
//! in the rows (a latency-bound pass) and drafting is cheap the deepest draft wins; where `T`
//! grows linearly from the first row (compute-bound), or drafting costs more than it saves, no
//! draft pays; in between the depth falls as the batch grows.
//!
//! That model misses how sessions fall out of step in a shared pass: a session still drafting
//! when the next pass starts waits for the one after. So the gate also measures what each depth
//! costs now: per depth, a session's time from one answer to the next. A depth measured within
//! [`GAP_MEMORY`] at the batch's load level (batches of `2^k..2^(k+1)` sessions share one) is
//! judged by `E(d)` over its measured cycle, the others by the model; a measurement that ages
//! out lets the model try its depth again. A drafted depth that the model says beats none but
//! for the margin ([`DRAFT_MARGIN`]) and that has not been measured at the batch's level is
//! advised, where the sessions' depth is known, until two of its rounds are: the model prices
//! drafting from gaps borrowed from another level or measured beside other sessions' first
//! drafts, and only measured rounds correct it. (The tokens a depth's rounds emitted are not
//! used: `E(d)` from the acceptance every depth's verdicts measure is the steadier estimate,
//! where a few unlucky rounds would otherwise keep a depth from being tried again.) Gaps and
//! rounds are kept per load level: what a depth cost one session alone says nothing of what it
//! costs four sessions sharing a draft worker.
//!
//! A session's cycle that spans another session's prompt round is not measured: a prompt's
//! prefill holds the passes back while it runs, so while new sessions arrive every cycle would
//! look several times longer than a round costs.
//!
//! A first measurement alone is provisional: the first pass of a row count and the first round
//! of a depth may have stalled (kernels compiled, CUDA graphs captured), and a depth priced by
//! such a stall would never be advised again to correct it. So a row bucket of one pass that is
//! slower than the buckets of several passes predict is left out of the model, and a depth's
//! cycle of one round can only make that depth look better than the model does. Likewise a
//! depth's gaps and cycles of a few rounds close together stand only for
//! [`PROVISIONAL_MEMORY`]: the first drafted rounds at a new load, measured while every
//! session's draft starts, could otherwise price drafting off at that load for the whole of
//! [`GAP_MEMORY`]; once they lapse the depth is tried again, and its new samples join them.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use specsplit_core::load::{load_level, LOAD_LEVELS};

/// Row buckets of the pass-time table: bucket `k` holds passes of `2^k..2^(k+1)` rows.
const BUCKETS: usize = 24;

/// Weight of a new pass in its bucket's running means.
const PASS_WEIGHT: f64 = 0.2;

/// Passes the gate must have measured before it advises.
const MIN_PASSES: u64 = 4;

/// Draft tokens the gate must have seen tried before it advises.
const MIN_TRIED: u64 = 8;

/// The acceptance estimate is kept below 1 so that deeper drafts always cost something.
const MAX_ACCEPTANCE: f64 = 0.999;

/// How long the deepest draft sessions sent by themselves caps the advice after the last such
/// round: long enough to span a generation's last rounds, cut short by its end, and short
/// enough that a cap mistaken from them lifts within a few generations.
const DEEPEST_MEMORY: Duration = Duration::from_secs(2);

/// How much more a draft must promise than none (tokens a second) to be advised. The model
/// and the rounds measured leave out what drafting costs besides its rounds: turning it on
/// catches every session's draft up with the tokens it missed, and sessions that draft fall
/// out of step with one another, so the batch splits into more passes. Near the break-even
/// (a large batch) those costs decide, and without a margin the gate drafts where it loses.
const DRAFT_MARGIN: f64 = 1.25;

/// Samples kept of each measured gap and cycle; their lower median stands for it.
const RECENT: usize = 8;

/// How long a provisional measurement (fewer than [`RECENT`] samples, spanning less than
/// [`SETTLE_SPAN`] since they last lapsed) stands after its latest sample. The first drafted
/// rounds at a new load are measured while every session's draft starts (the draft catches up
/// with its prompt, CUDA graphs of the new shapes are captured), and they can price a depth at
/// several times its cost; once the gate advises against that depth its measurement is not
/// refreshed, so it must lapse soon for the depth to be measured again.
const PROVISIONAL_MEMORY: Duration = Duration::from_millis(500);

/// The span of samples that settles a measurement of fewer than [`RECENT`] samples: a depth
/// measured that long without a lapse (at a load that sends few samples a round, such as one
/// session with slow rounds) stands for [`GAP_MEMORY`] like one of [`RECENT`] samples.
const SETTLE_SPAN: Duration = Duration::from_secs(1);

/// A session's gap between an answer and its next request longer than this is a pause of
/// its client (between generations, or a slow consumer), not the cost of drafting.
pub const MAX_ROUND_GAP: Duration = Duration::from_secs(2);

/// A depth's gap or rounds measured longer ago than this are forgotten, and the depth is tried
/// again: the draft worker may be busier or idler now than then. (A change of the target's own
/// batch moves to another load level, which keeps its own measurements; this memory bounds how
/// long a level's stay valid.)
const GAP_MEMORY: Duration = Duration::from_secs(30);

/// A session answered within this window counts in the batch the advice is for.
const ACTIVE_WINDOW: Duration = Duration::from_millis(500);

/// How long the largest batch served stands for the batch the advice is for (see
/// [`LoadGate::note_batch`]): long enough to span the arrival of a burst's sessions and the
/// pause between a client's batches, short enough that a quiet spell after a busy one drafts
/// again within a few generations.
const PEAK_MEMORY: Duration = Duration::from_secs(2);

/// Sessions whose last answer the advisor remembers (their gaps are measured); beyond this,
/// the oldest answers are forgotten.
const MAX_REMEMBERED_SESSIONS: usize = 4096;

/// The gap at depth `d` from the gaps `known` (depth, seconds; by depth) of one load level:
/// see [`LoadGate::round_gap`]. 0 where nothing is known.
fn interpolate_gap(known: &[(f64, f64)], d: f64) -> f64 {
    let Some(&(d0, g0)) = known.first() else {
        return 0.0;
    };
    if d <= d0 {
        return if d0 == 0.0 { g0 } else { g0 * d / d0 };
    }
    for w in known.windows(2) {
        let ((a, ga), (b, gb)) = (w[0], w[1]);
        if d <= b {
            return ga + (gb - ga) * (d - a) / (b - a);
        }
    }
    // Beyond the deepest measured depth: along the slope of the last two drafted depths, or
    // flat where only one drafted depth was measured. A slope through depth 0 would charge
    // every further level the draft call's fixed cost too, and keep deeper drafts from ever
    // being tried; flat is optimistic, so they are tried, and then measured.
    let (b, gb) = known[known.len() - 1];
    let mut drafted = known.iter().rev().filter(|&&(k, _)| k > 0.0);
    let slope = match (drafted.next(), drafted.next()) {
        (Some(z), Some(a)) => ((z.1 - a.1) / (z.0 - a.0)).max(0.0),
        _ => 0.0,
    };
    gb + slope * (d - b)
}

/// The gaps the gate predicts at one load level (see [`LoadGate::round_gap`]): the points
/// (depth, seconds) measured there, or another level's, whose drafting time is then added to
/// `base` scaled by `scale`.
struct GapCurve {
    points: Vec<(f64, f64)>,
    borrowed: Option<(f64, f64)>,
}

impl GapCurve {
    /// The gap before a request drafted to `depth`, in seconds.
    fn at(&self, depth: usize) -> f64 {
        let d = depth as f64;
        match self.borrowed {
            None => interpolate_gap(&self.points, d),
            Some((base, scale)) => {
                let drafting =
                    interpolate_gap(&self.points, d) - interpolate_gap(&self.points, 0.0);
                base + drafting.max(0.0) * scale
            }
        }
    }
}

/// The pass time the table points `pts` (at least two, by rows) predict for `rows` rows, in
/// seconds: see [`LoadGate::pass_secs`].
fn pass_at(pts: &[Point], rows: f64) -> f64 {
    let first = pts[0];
    if rows <= first.rows {
        return first.secs;
    }
    for w in pts.windows(2) {
        let (a, b) = (w[0], w[1]);
        if rows <= b.rows {
            return a.secs + (b.secs - a.secs) * (rows - a.rows) / (b.rows - a.rows);
        }
    }
    let (a, b) = (pts[pts.len() - 2], pts[pts.len() - 1]);
    let slope = ((b.secs - a.secs) / (b.rows - a.rows)).max(0.0);
    b.secs + slope * (rows - b.rows)
}

/// The time of a pass of `rows` rows as the model runs it, from the table points `pts`: past
/// `group` rows, in the fewest groups of at most `group` rows, each a pass of its own (the
/// groups taken as equal).
fn grouped_pass_at(pts: &[Point], rows: f64, group: Option<usize>) -> f64 {
    match group {
        Some(g) if rows > g as f64 => {
            let n = (rows / g as f64).ceil();
            n * pass_at(pts, rows / n)
        }
        _ => pass_at(pts, rows),
    }
}

/// Running means of the passes of one row bucket.
#[derive(Debug, Clone, Copy)]
struct Point {
    /// Mean rows of the bucket's passes.
    rows: f64,
    /// Mean pass time, in seconds.
    secs: f64,
    /// Passes recorded (counted up to 2: a bucket of one pass is provisional).
    seen: u8,
}

/// The cost model behind load-gated speculation: a bounded table of measured pass times per
/// row count and the running acceptance of the verified drafts.
#[derive(Debug, Clone)]
pub struct LoadGate {
    /// Deepest draft the gate advises.
    max_depth: usize,
    /// The most rows the model runs the sessions of a pass together; past it, in groups of at
    /// most this many, each a pass over the weights (`None`: any number together).
    group_rows: Option<usize>,
    /// Running means per row bucket (`None`: no pass of that size yet).
    table: [Option<Point>; BUCKETS],
    /// Passes measured.
    passes: u64,
    /// Draft tokens tried (every accepted one, and the first rejected one of each verdict)
    /// and accepted.
    tried: u64,
    accepted: u64,
    /// Per load level, then per drafted depth of the request: the latest gaps (seconds)
    /// between an answer and the session's next request (`None`: not measured).
    gaps: Vec<Vec<Option<Recent>>>,
    /// Per load level, then per drafted depth: the latest times (seconds) from a session's
    /// answer to its next (its cycle).
    cycles: Vec<Vec<Option<Recent>>>,
    /// The deepest draft a session sent lately, and when: deeper depths are not advised (the
    /// sessions would not draft them, so they would never be measured).
    deepest: Option<(usize, Instant)>,
    /// The latest advice given: a round as deep as it shows no more than the cap.
    last_advice: Option<usize>,
    /// When a new prompt's round was last answered: a cycle that spans it is not measured.
    last_prompt: Option<Instant>,
    /// The largest batch served lately, and when it was last served (see
    /// [`LoadGate::note_batch`]).
    peak_batch: Option<(usize, Instant)>,
}

/// The latest samples of one measurement (a depth's gap or cycle at one load level), whose
/// lower median stands for it: a one-off stall among them (a CUDA graph captured, a cache
/// grown) moves it no more than any other sample, where it would hold a running mean up, and
/// keep its depth from being tried again, for many rounds.
///
/// A measurement of few samples taken close together is provisional (see
/// [`PROVISIONAL_MEMORY`]): it stands only briefly after its latest sample, and the samples
/// of the depth's next trial join it.
#[derive(Debug, Clone, Copy)]
struct Recent {
    samples: [f64; RECENT],
    len: usize,
    next: usize,
    /// When the latest sample was taken.
    at: Instant,
    /// When the first sample of these was taken, or the first after they last lapsed (see
    /// [`Recent::record`]).
    since: Instant,
}

impl Recent {
    /// Adds `x`, taken at `now`, to `slot`: to its samples (the oldest dropped) where they are
    /// within [`GAP_MEMORY`], else as the first of fresh ones. A sample that joins samples
    /// that had lapsed (see [`Recent::stands`]) starts their span anew: a trial after a lapse
    /// settles them only by a span of its own, so that its first sample cannot settle a few
    /// earlier ones that outvote it.
    fn record(slot: &mut Option<Recent>, x: f64, now: Instant) {
        match slot {
            Some(r) if r.fresh(now) => {
                if !r.stands(now) {
                    r.since = now;
                }
                r.samples[r.next] = x;
                r.next = (r.next + 1) % RECENT;
                r.len = (r.len + 1).min(RECENT);
                r.at = now;
            }
            _ => {
                let mut samples = [0.0; RECENT];
                samples[0] = x;
                *slot = Some(Recent {
                    samples,
                    len: 1,
                    next: 1,
                    at: now,
                    since: now,
                });
            }
        }
    }

    /// Whether the latest sample is within [`GAP_MEMORY`] of `now` (later samples join it).
    fn fresh(&self, now: Instant) -> bool {
        now.saturating_duration_since(self.at) <= GAP_MEMORY
    }

    /// Whether the measurement is settled: [`RECENT`] samples, or samples spanning at least
    /// [`SETTLE_SPAN`] since they last lapsed.
    fn settled(&self) -> bool {
        self.len >= RECENT || self.at.saturating_duration_since(self.since) >= SETTLE_SPAN
    }

    /// Whether the measurement stands at `now`: its latest sample within [`GAP_MEMORY`] where
    /// it is settled, within [`PROVISIONAL_MEMORY`] where it is not.
    fn stands(&self, now: Instant) -> bool {
        let memory = if self.settled() {
            GAP_MEMORY
        } else {
            PROVISIONAL_MEMORY
        };
        now.saturating_duration_since(self.at) <= memory
    }

    /// The lower median of the samples.
    fn median(&self) -> f64 {
        let mut s = self.samples;
        let s = &mut s[..self.len];
        s.sort_by(f64::total_cmp);
        s[(self.len - 1) / 2]
    }
}

impl LoadGate {
    /// A gate that advises depths up to `max_depth`, with nothing measured yet.
    pub fn new(max_depth: usize) -> Self {
        Self {
            max_depth,
            group_rows: None,
            table: [None; BUCKETS],
            passes: 0,
            tried: 0,
            accepted: 0,
            gaps: vec![vec![None; max_depth + 1]; LOAD_LEVELS],
            cycles: vec![vec![None; max_depth + 1]; LOAD_LEVELS],
            deepest: None,
            last_advice: None,
            last_prompt: None,
            peak_batch: None,
        }
    }

    /// The gate for a model that runs the sessions of a pass in groups of at most `rows` rows
    /// (`None`: all together; see `Transformer::session_group_rows`): a round whose sessions'
    /// rows exceed that is priced as several passes, where extending the table's last slope
    /// would price it as one.
    pub fn with_group_rows(mut self, rows: Option<usize>) -> Self {
        self.group_rows = rows.filter(|&r| r > 0);
        self
    }

    /// Notes a round answered at `now` in a batch of `batch` sessions; returns the largest
    /// batch served within [`PEAK_MEMORY`] (this one included), the batch the advice is for.
    /// The batch a target serves rises at once and is counted late: the sessions of a burst
    /// arrive together, but their requests are counted only as the worker takes them while it
    /// prefills the first prompts, so the first sessions are answered as if nearly alone.
    /// Advised for that batch, they draft their next rounds, and a session's first draft is
    /// its prompt's prefill in the draft model, which beside the target's passes takes many
    /// times its time alone, only for the advice at the whole burst's batch to turn drafting
    /// off a few rounds later. (A peak is kept until a batch as large is served or the memory
    /// passes, then the batch of the moment takes its place.)
    fn note_batch(&mut self, batch: usize, now: Instant) -> usize {
        let peak = match self.peak_batch {
            Some((b, at)) if b > batch && now.saturating_duration_since(at) <= PEAK_MEMORY => {
                (b, at)
            }
            _ => (batch, now),
        };
        self.peak_batch = Some(peak);
        peak.0
    }

    /// Records a session's round drafted to `depth` (deeper counts as `max_depth`) that was
    /// answered `cycle` after the session's previous answer, in a batch of `batch` sessions.
    pub fn observe_cycle(&mut self, depth: usize, cycle: Duration, batch: usize) {
        if cycle > MAX_ROUND_GAP {
            return;
        }
        let (c, now) = (cycle.as_secs_f64(), Instant::now());
        let fresh = |at: Instant| now.duration_since(at) <= DEEPEST_MEMORY;
        // A round shallower than the advice shows how deep its session drafts by itself; one
        // as deep as the advice only that the advice capped it, which says nothing of the cap
        // to keep (were it kept, the advice would hold itself down).
        let capped = self.last_advice.is_some_and(|a| depth >= a);
        if !capped {
            self.deepest = match self.deepest {
                Some((d, at)) if fresh(at) && d > depth => Some((d, at)),
                _ => Some((depth, now)),
            };
        }
        Recent::record(
            &mut self.cycles[load_level(batch)][depth.min(self.max_depth)],
            c,
            now,
        );
    }

    /// Notes how deep a session drafts by itself (`limit`, as its orchestrator told it; 0: not
    /// told): the advice goes no deeper than the deepest of these within [`DEEPEST_MEMORY`].
    /// Where it is told, the shallower rounds that the end of a generation forces (no deeper
    /// than the tokens it may still emit) do not hold every session's advice down.
    pub fn observe_depth_limit(&mut self, limit: usize) {
        if limit == 0 {
            return;
        }
        let now = Instant::now();
        self.deepest = match self.deepest {
            Some((d, at)) if now.duration_since(at) <= DEEPEST_MEMORY && d > limit => Some((d, at)),
            _ => Some((limit, now)),
        };
    }

    /// The cycle (seconds) a session's rounds of `depth` measured at load level `level`, where
    /// that measurement still stands (see [`PROVISIONAL_MEMORY`]), and how many rounds stand
    /// for it.
    fn measured_cycle(&self, depth: usize, level: usize, now: Instant) -> Option<(f64, usize)> {
        self.cycles[level][depth]
            .filter(|c| c.stands(now))
            .map(|c| (c.median(), c.len))
    }

    /// Records the `gap` between an answer to a session and its next request, which drafted
    /// to `depth` (deeper than the gate's `max_depth` counts as `max_depth`), in a batch of
    /// `batch` sessions.
    pub fn observe_gap(&mut self, depth: usize, gap: Duration, batch: usize) {
        if gap > MAX_ROUND_GAP {
            return;
        }
        let (g, now) = (gap.as_secs_f64(), Instant::now());
        Recent::record(
            &mut self.gaps[load_level(batch)][depth.min(self.max_depth)],
            g,
            now,
        );
    }

    /// The gap the gate predicts after an answer before a request drafted to `depth` in a
    /// batch of `batch` sessions, in seconds.
    ///
    /// From the gaps measured at the batch's load level where a drafted depth was measured
    /// there: the measured value, else linear between the nearest measured depths, else along
    /// the line from the nearest measured depth to no gap at depth 0 below it, or above them
    /// along the last two measured drafted depths' slope (never falling), flat where only one
    /// drafted depth was measured (optimistic, so that a deeper draft is tried and measured
    /// rather than charged the draft call's fixed cost once a level). Where no drafted depth was
    /// measured at this level, the nearest level's drafting time (its gap beyond its depth-0
    /// gap) stands in, scaled by the ratio of the levels' batches, as if the draft worker
    /// served the sessions one after another: what one session's draft cost alone, four cost
    /// about four times over, until measured. 0 before any gap is measured (the pass time alone
    /// decides). Gaps measured more than [`GAP_MEMORY`] ago count as unmeasured, and so do a
    /// few taken close together more than [`PROVISIONAL_MEMORY`] ago.
    pub fn round_gap(&self, depth: usize, batch: usize) -> f64 {
        self.gap_curve(batch).at(depth)
    }

    /// The gaps [`LoadGate::round_gap`] predicts for a batch of `batch` sessions, at every
    /// depth.
    fn gap_curve(&self, batch: usize) -> GapCurve {
        let level = load_level(batch);
        let own = self.known_gaps(level);
        let drafted = |k: &[(f64, f64)]| k.iter().any(|&(d, _)| d > 0.0);
        if drafted(&own) {
            return GapCurve {
                points: own,
                borrowed: None,
            };
        }
        let nearest = (1..LOAD_LEVELS).find_map(|step| {
            [level.checked_sub(step), Some(level + step)]
                .into_iter()
                .flatten()
                .filter(|&k| k < LOAD_LEVELS)
                .map(|k| (k, self.known_gaps(k)))
                .find(|(_, g)| drafted(g))
        });
        let Some((k, other)) = nearest else {
            return GapCurve {
                points: own,
                borrowed: None,
            };
        };
        let base = match own.first() {
            Some(&(0.0, g0)) => g0,
            _ => interpolate_gap(&other, 0.0),
        };
        GapCurve {
            points: other,
            borrowed: Some((base, 2f64.powi(level as i32 - k as i32))),
        }
    }

    /// The gaps measured at load level `level` that still stand (see [`PROVISIONAL_MEMORY`]):
    /// (depth, seconds), by depth.
    fn known_gaps(&self, level: usize) -> Vec<(f64, f64)> {
        let now = Instant::now();
        self.gaps[level]
            .iter()
            .enumerate()
            .filter_map(|(d, g)| g.filter(|g| g.stands(now)).map(|g| (d as f64, g.median())))
            .collect()
    }

    /// Records one target pass of `rows` rows (all sessions' tokens) that took `time` in the
    /// model. A pass of no rows is ignored.
    ///
    /// A pass that took more than twice what its rows would take as passes of a smaller
    /// measured size, one after another, is a stall (kernels compiled or a graph captured at
    /// their first use, a cache grown), not its size's cost, and is not recorded: the first
    /// pass of a size seeds its mean, and a size that looks too slow is never run again to
    /// correct it.
    pub fn observe_pass(&mut self, rows: usize, time: Duration) {
        if rows == 0 {
            return;
        }
        let k = (usize::BITS - 1 - rows.leading_zeros()) as usize;
        let k = k.min(BUCKETS - 1);
        let (r, s) = (rows as f64, time.as_secs_f64());
        let bound = self
            .table
            .iter()
            .flatten()
            .filter(|p| p.rows <= r)
            .map(|p| (r / p.rows).ceil() * p.secs)
            .min_by(f64::total_cmp);
        if bound.is_some_and(|b| s > 2.0 * b) {
            return;
        }
        self.table[k] = Some(match self.table[k] {
            None => Point {
                rows: r,
                secs: s,
                seen: 1,
            },
            // The first pass of a size may have stalled (its graph captured): a faster second
            // one replaces it.
            Some(p) if p.seen == 1 && s < p.secs => Point {
                rows: r,
                secs: s,
                seen: 2,
            },
            Some(p) => Point {
                rows: p.rows + PASS_WEIGHT * (r - p.rows),
                secs: p.secs + PASS_WEIGHT * (s - p.secs),
                seen: 2,
            },
        });
        self.passes += 1;
    }

    /// Records one verdict: `accepted` of the `drafted` tokens on the draft's longest path.
    /// A draft token is tried when every token before it was accepted: the accepted ones, and
    /// the first rejected one if any.
    pub fn observe_verdict(&mut self, drafted: usize, accepted: usize) {
        let accepted = accepted.min(drafted);
        self.accepted += accepted as u64;
        self.tried += (accepted + usize::from(accepted < drafted)) as u64;
    }

    /// The running per-token acceptance estimate α: accepted ÷ tried draft tokens (the
    /// geometric model's maximum-likelihood estimate, unbiased by the chains' depth); `None`
    /// before enough tries.
    pub fn acceptance(&self) -> Option<f64> {
        (self.tried >= MIN_TRIED)
            .then(|| (self.accepted as f64 / self.tried as f64).min(MAX_ACCEPTANCE))
    }

    /// The pass time the table predicts for `rows` rows, in seconds: piecewise linear between
    /// the measured buckets, flat below the smallest, extended along the last two buckets'
    /// slope (never falling) above the largest. `None` with fewer than two buckets measured.
    pub fn pass_secs(&self, rows: f64) -> Option<f64> {
        self.pass_points().map(|pts| pass_at(&pts, rows))
    }

    /// The measured buckets, by rows; `None` with fewer than two. A bucket of one pass that
    /// took longer than the buckets of several passes predict for its rows is left out: a
    /// size's first pass may have stalled (kernels compiled or a graph captured at its first
    /// use), and a size priced by a stall would never be run again to correct it.
    fn pass_points(&self) -> Option<Vec<Point>> {
        let all = || self.table.iter().flatten().copied();
        let settled: Vec<Point> = all().filter(|p| p.seen >= 2).collect();
        let pts: Vec<Point> = if settled.len() >= 2 {
            all()
                .filter(|p| p.seen >= 2 || p.secs <= pass_at(&settled, p.rows))
                .collect()
        } else {
            all().collect()
        };
        (pts.len() >= 2).then_some(pts)
    }

    /// The draft depth in `0..=max_depth` that maximises the aggregate expected tokens per
    /// second of `batch_sessions` sessions sharing each pass, each away from the target for
    /// its round's gap between passes (the shallowest of equals);
    /// `None` before the gate has measured enough passes and verdicts to say.
    ///
    /// Where none wins only by the margin, a drafted depth that beats none without it and has
    /// not been measured at this load level (fewer than two rounds that stand) is
    /// advised, where the sessions' depth is known, so that it is: the margin stands for costs
    /// the model leaves out, which only rounds of that depth show, and a model that overprices
    /// drafting (its drafting time borrowed from another level, or measured beside other
    /// sessions' first drafts) would otherwise never be corrected.
    pub fn advise(&self, batch_sessions: usize) -> Option<usize> {
        let mut best = (0, f64::NEG_INFINITY);
        // Depth 0's rate, the margin included; and the best drafted depth not yet measured.
        let mut none = 0.0;
        let mut untried = (0, f64::NEG_INFINITY);
        self.each_depth(batch_sessions, |d| {
            if d.rate > best.1 {
                best = (d.depth, d.rate);
            }
            if d.depth == 0 {
                none = d.rate;
            } else if d.measured.is_none_or(|n| n < 2) && d.rate > untried.1 {
                untried = (d.depth, d.rate);
            }
        })?;
        // Only a depth the sessions draft is measured: without their depth known, a trial
        // could be of a depth none of them drafts, and never end.
        let known = self.deepest_drafted(Instant::now()).is_some();
        if best.0 == 0 && known && untried.1 > none / DRAFT_MARGIN {
            return Some(untried.0);
        }
        Some(best.0)
    }

    /// The deepest draft sessions drafted or told lately (within [`DEEPEST_MEMORY`] of `now`),
    /// if any did: the deepest depth the gate weighs.
    fn deepest_drafted(&self, now: Instant) -> Option<usize> {
        self.deepest
            .filter(|&(d, at)| d > 0 && now.duration_since(at) <= DEEPEST_MEMORY)
            .map(|(d, _)| d)
    }

    /// What [`LoadGate::advise`] weighed for `batch_sessions` sessions, one entry a depth
    /// (`None` where it gives no advice): for the worker's debug log when the advice changes.
    pub fn explain(&self, batch_sessions: usize) -> Option<String> {
        let alpha = self.acceptance()?;
        let mut out = format!("batch {batch_sessions}, acceptance {alpha:.3}:");
        self.each_depth(batch_sessions, |d| {
            let from = match d.measured {
                Some(n) => format!("{n} rounds measured"),
                None => "modelled".into(),
            };
            out.push_str(&format!(
                " depth {} {:.2} ms a round ({from}) {:.1} tok/s;",
                d.depth,
                d.secs * 1e3,
                d.rate
            ));
        })?;
        Some(out)
    }

    /// Calls `f` with every depth the gate weighs for `batch_sessions` sessions, in order
    /// (`None`, calling nothing, before it has measured enough passes and verdicts).
    fn each_depth(&self, batch_sessions: usize, mut f: impl FnMut(Weighed)) -> Option<()> {
        if self.passes < MIN_PASSES {
            return None;
        }
        let alpha = self.acceptance()?;
        // Pass times and gaps are derived once for every depth.
        let pts = self.pass_points()?;
        let gaps = self.gap_curve(batch_sessions);
        let b = batch_sessions.max(1) as f64;
        let level = load_level(batch_sessions);
        let now = Instant::now();
        let mut expected = 0.0;
        let mut term = 1.0;
        let top = self
            .deepest_drafted(now)
            .map_or(self.max_depth, |d| d.min(self.max_depth));
        for depth in 0..=top {
            expected += term;
            term *= alpha;
            let rows = b * (depth + 1) as f64;
            let modelled = grouped_pass_at(&pts, rows, self.group_rows) + gaps.at(depth);
            // One round measured alone may have stalled (a graph captured at its first use):
            // it can only make its depth look better than the model does, never worse.
            let measured = self.measured_cycle(depth, level, now);
            let secs = match measured {
                Some((c, 1)) => c.min(modelled),
                Some((c, _)) => c,
                None => modelled,
            };
            let rate = b * expected / secs.max(f64::MIN_POSITIVE);
            // A draft must beat none by the margin (see DRAFT_MARGIN).
            let rate = if depth == 0 {
                rate * DRAFT_MARGIN
            } else {
                rate
            };
            f(Weighed {
                depth,
                secs,
                measured: measured.map(|(_, n)| n),
                rate,
            });
        }
        Some(())
    }
}

/// One depth as [`LoadGate::advise`] weighs it.
struct Weighed {
    depth: usize,
    /// A round's time, measured or modelled.
    secs: f64,
    /// The rounds measured that stand for it (`None`: modelled).
    measured: Option<usize>,
    /// Tokens a second of the batch (depth 0's times the margin).
    rate: f64,
}

/// A [`LoadGate`] shared by a target's concurrent requests, with the count of verify requests
/// in flight that stands for the batch.
#[derive(Debug)]
pub struct LoadAdvisor {
    gate: Mutex<LoadGate>,
    in_flight: AtomicUsize,
    /// The batch of the latest answer (the sessions in flight or answered within
    /// [`ACTIVE_WINDOW`], not the larger batch its advice was for): the load a session's gap
    /// before its next request is spent under.
    batch: AtomicUsize,
    /// When each session was last answered (its gap to its next request is measured).
    answered: Mutex<HashMap<String, Answered>>,
}

/// A verify request counted in flight until dropped.
#[derive(Debug)]
pub struct InFlight<'a>(&'a AtomicUsize);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl LoadAdvisor {
    /// An advisor over a fresh gate advising depths up to `max_depth`.
    pub fn new(max_depth: usize) -> Self {
        Self::with_gate(LoadGate::new(max_depth))
    }

    /// An advisor over `gate`, as it has measured so far.
    pub fn with_gate(gate: LoadGate) -> Self {
        Self {
            gate: Mutex::new(gate),
            in_flight: AtomicUsize::new(0),
            batch: AtomicUsize::new(1),
            answered: Mutex::new(HashMap::new()),
        }
    }

    /// The sessions' last answers, locked (a panic elsewhere leaves them usable).
    fn answered(&self) -> std::sync::MutexGuard<'_, HashMap<String, Answered>> {
        self.answered.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Forgets `session`, which ended: it no longer counts in the batch (it would for
    /// [`ACTIVE_WINDOW`] after its last answer), and a later session of that id starts afresh.
    pub fn forget(&self, session: &str) {
        self.answered().remove(session);
    }

    /// Sessions whose last answer the advisor remembers (ended ones are forgotten).
    pub fn sessions_remembered(&self) -> usize {
        self.answered().len()
    }

    /// Records that `session`'s next round, drafted to `depth`, arrived at `arrived`: its gap
    /// since the session's last answer. Call it for a session's later rounds only (a new
    /// prompt follows a pause, not a draft).
    pub fn observe_request(&self, session: &str, depth: usize, arrived: Instant) {
        let last = {
            let answered = self.answered();
            answered.get(session).copied().filter(|a| a.measures(depth))
        };
        if let Some(gap) = last.and_then(|a| arrived.checked_duration_since(a.at)) {
            let batch = self.batch.load(Ordering::Relaxed);
            tracing::trace!(
                session,
                depth,
                batch,
                gap_ms = gap.as_secs_f64() * 1e3,
                "gap"
            );
            let mut g = self.gate.lock().unwrap_or_else(|e| e.into_inner());
            g.observe_gap(depth, gap, batch);
        }
    }

    /// Notes `session` answered at `at`, a round drafted to `depth` that `continued` its
    /// sequence or a new prompt's; returns the sessions answered within [`ACTIVE_WINDOW`] of
    /// `at` (this one included) and when this one was answered before, if the round's cycle
    /// is measured.
    fn note_answer(
        &self,
        session: &str,
        at: Instant,
        depth: usize,
        continued: bool,
    ) -> (usize, Option<Instant>) {
        let mut answered = self.answered();
        if answered.len() >= MAX_REMEMBERED_SESSIONS && !answered.contains_key(session) {
            answered.retain(|_, a| at.saturating_duration_since(a.at) <= MAX_ROUND_GAP);
            if answered.len() >= MAX_REMEMBERED_SESSIONS {
                answered.clear();
            }
        }
        // A known session's entry is updated in place: no allocation a round.
        let last = match answered.get_mut(session) {
            Some(a) => {
                let last = *a;
                a.at = at;
                a.depth = depth;
                a.rounds = if continued {
                    last.rounds.saturating_add(1)
                } else {
                    0
                };
                Some(last)
            }
            None => {
                answered.insert(
                    session.to_string(),
                    Answered {
                        at,
                        rounds: 0,
                        depth,
                    },
                );
                None
            }
        };
        let active = answered
            .values()
            .filter(|a| at.saturating_duration_since(a.at) <= ACTIVE_WINDOW)
            .count();
        let measured = last
            .filter(|a| continued && a.measures(depth))
            .map(|a| a.at);
        (active, measured)
    }

    /// Counts a verify request in flight while the returned guard lives.
    pub fn enter(&self) -> InFlight<'_> {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight(&self.in_flight)
    }

    /// Verify requests in flight now.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Records `round`, answered now; returns the depth advised for the batch: the largest
    /// within [`PEAK_MEMORY`] (see [`LoadGate::note_batch`]) of the sessions in flight or
    /// answered within [`ACTIVE_WINDOW`], whichever are more.
    pub fn observe_and_advise(&self, round: GateRound<'_>) -> Option<usize> {
        let now = Instant::now();
        let (active, last) = if round.session.is_empty() {
            (0, None)
        } else {
            self.note_answer(round.session, now, round.depth, round.continued)
        };
        let batch = self.in_flight().max(active);
        self.batch.store(batch, Ordering::Relaxed);
        let mut g = self.gate.lock().unwrap_or_else(|e| e.into_inner());
        // The advice is for the batch served lately (see note_batch); gaps and cycles are
        // measured at the batch of the moment.
        let advised_for = g.note_batch(batch, now);
        g.observe_depth_limit(round.depth_limit);
        // A new prompt's round spends its model time on the prompt's prefill too (a pass of
        // another kind: a causal product over the prompt's rows, and no tree); priced as a
        // verify pass of its rows, it would make large passes look cheap, and the gate draft
        // where drafting loses.
        if round.continued {
            g.observe_pass(round.rows, round.time);
        }
        if round.depth > 0 {
            g.observe_verdict(round.depth, round.accepted);
        }
        // A cycle that spans another session's prompt waited for its prefill (a causal pass
        // over the whole prompt, which holds the passes back while it runs): a ramp of new
        // sessions would price target-only rounds at several times their cost, and the gate
        // draft where drafting loses.
        let spans_prompt = |last: Instant| g.last_prompt.is_some_and(|p| p > last);
        let cycle = last
            .filter(|&l| !round.one_off_setup && !spans_prompt(l))
            .map(|l| now.saturating_duration_since(l));
        if let Some(cycle) = cycle {
            g.observe_cycle(round.depth, cycle, batch);
        }
        if !round.continued {
            g.last_prompt = Some(now);
        }
        let advice = g.advise(advised_for);
        if advice != g.last_advice && tracing::enabled!(tracing::Level::DEBUG) {
            tracing::debug!(
                "load advice {:?} (was {:?}); {}",
                advice,
                g.last_advice,
                g.explain(advised_for).unwrap_or_default()
            );
        }
        // What observe_cycle needs to tell rounds the advice capped from shallower ones.
        g.last_advice = advice;
        // The trace is written with the gate unlocked: the other requests' rounds need it.
        drop(g);
        if let Some(cycle) = cycle {
            tracing::trace!(
                session = round.session,
                depth = round.depth,
                batch,
                cycle_ms = cycle.as_secs_f64() * 1e3,
                "cycle"
            );
        }
        tracing::trace!(
            session = round.session,
            depth = round.depth,
            rows = round.rows,
            model_ms = round.time.as_secs_f64() * 1e3,
            continued = round.continued,
            one_off_setup = round.one_off_setup,
            batch,
            advised_for,
            advice,
            "round"
        );
        advice
    }
}

/// A session's last answer.
#[derive(Debug, Clone, Copy)]
struct Answered {
    at: Instant,
    /// Rounds answered since the session's prompt. The first round after a prompt waits for
    /// the draft to catch up with the prompt: neither its gap nor its cycle is a round's.
    rounds: u32,
    /// The depth of the answered round's draft (0: none).
    depth: usize,
}

impl Answered {
    /// Whether the gap and cycle of the session's next round, drafted to `depth`, are
    /// measured: not after a prompt, and not for a draft after a round without one, which
    /// first catches the draft up with the tokens it missed (a prefill, maybe a new graph
    /// captured), a cost of turning drafting back on rather than of the depth: priced by it,
    /// drafting would never be tried again where it pays.
    fn measures(&self, depth: usize) -> bool {
        self.rounds >= 1 && !(self.depth == 0 && depth > 0)
    }
}

/// One verified round, as [`LoadAdvisor::observe_and_advise`] takes it.
#[derive(Debug, Clone, Copy)]
pub struct GateRound<'a> {
    /// The session's id (empty: an anonymous session, whose rounds are not followed).
    pub session: &'a str,
    /// Rows of the pass the round ran in (all its sessions'), and its own preparation's.
    pub rows: usize,
    /// The round's model time. Only a continuing round's (see `continued`) prices a pass.
    pub time: Duration,
    /// The depth of the round's draft (0: none).
    pub depth: usize,
    /// Draft tokens the target accepted.
    pub accepted: usize,
    /// Whether the round continued the session's sequence (not a new prompt), so that its
    /// time since the session's last answer is a round's.
    pub continued: bool,
    /// Whether the round's time includes one-off setup on either worker (its draft's or its
    /// verify's model made a CUDA graph): then its cycle is not measured, since a new shape's
    /// stall, which every session of a shared pass feels at once, would price its depth for
    /// the whole memory of the gate.
    pub one_off_setup: bool,
    /// How deep the session drafts by itself, as its orchestrator tells it (0: not told): the
    /// depth it would have drafted but for the advice and the end of its generation.
    pub depth_limit: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A gate fed passes of every row count in `rows` timed by `t` (seconds), and verdicts of
    /// a per-token acceptance of 0.8.
    fn gate(max: usize, rows: impl IntoIterator<Item = usize>, t: impl Fn(f64) -> f64) -> LoadGate {
        let mut g = LoadGate::new(max);
        for r in rows {
            g.observe_pass(r, Duration::from_secs_f64(t(r as f64)));
        }
        for i in 0..100 {
            g.observe_verdict(1, usize::from(i % 5 != 0));
        }
        g
    }

    #[test]
    fn acceptance_is_per_token_whatever_the_depth() {
        // Chains of depth 4 with α = 0.5: every accept/reject pattern in proportion.
        let mut g = LoadGate::new(4);
        for (accepted, times) in [(0, 8), (1, 4), (2, 2), (3, 1), (4, 1)] {
            for _ in 0..times {
                g.observe_verdict(4, accepted);
            }
        }
        let a = g.acceptance().expect("enough tries");
        assert!((a - 0.5).abs() < 1e-9, "{a}");
    }

    #[test]
    fn latency_bound_target_gets_the_deepest_draft() {
        let g = gate(8, 1..=600, |_| 0.02);
        for b in [1, 4, 16, 64] {
            assert_eq!(g.advise(b), Some(8), "batch {b}");
        }
    }

    #[test]
    fn compute_bound_target_gets_no_draft() {
        let g = gate(8, 1..=600, |r| 1e-3 * r);
        for b in [1, 4, 16, 64] {
            assert_eq!(g.advise(b), Some(0), "batch {b}");
        }
    }

    #[test]
    fn depth_falls_as_the_batch_grows_between_the_two() {
        // A roofline: weight reads cost 20 ms up to 64 rows, then each row costs 0.3 ms.
        let g = gate(8, 1..=600, |r| 0.02f64.max(3e-4 * r));
        let depths: Vec<usize> = [1, 4, 8, 16, 32, 64]
            .iter()
            .map(|&b| g.advise(b).expect("advice"))
            .collect();
        assert!(depths.windows(2).all(|w| w[0] >= w[1]), "{depths:?}");
        assert_eq!(depths[0], 8, "{depths:?}");
        assert!(depths[5] < 2, "{depths:?}");
        assert!(depths[2] > depths[5], "{depths:?}");
    }

    #[test]
    fn no_acceptance_gives_no_draft() {
        let mut g = LoadGate::new(8);
        for r in 1..=64 {
            g.observe_pass(r, Duration::from_millis(20));
        }
        for _ in 0..10 {
            g.observe_verdict(5, 0);
        }
        assert_eq!(g.acceptance(), Some(0.0));
        assert_eq!(g.advise(1), Some(0));
    }

    #[test]
    fn little_data_gives_no_advice() {
        let mut g = LoadGate::new(8);
        assert_eq!(g.advise(1), None);
        // Passes of one size only: nothing says how the time grows with the rows.
        for _ in 0..10 {
            g.observe_pass(5, Duration::from_millis(20));
        }
        g.observe_verdict(100, 80);
        assert_eq!(g.advise(1), None);
        // Pass times of two sizes, but no verdict on a draft yet.
        let mut g = LoadGate::new(8);
        for r in [1, 100, 1, 100] {
            g.observe_pass(r, Duration::from_millis(20));
        }
        assert_eq!(g.acceptance(), None);
        assert_eq!(g.advise(1), None);
        g.observe_verdict(100, 80);
        assert_eq!(g.advise(1), Some(8));
    }

    #[test]
    fn pass_time_interpolates_and_extrapolates_upwards() {
        let g = gate(4, [10, 20, 40], |r| 1e-3 * r);
        let at = |r: f64| g.pass_secs(r).expect("two buckets");
        assert!((at(30.0) - 0.03).abs() < 1e-9);
        assert!((at(80.0) - 0.08).abs() < 1e-9);
        assert!((at(1.0) - 0.01).abs() < 1e-9);
    }

    #[test]
    fn the_advisor_counts_requests_in_flight() {
        let a = LoadAdvisor::new(4);
        let g1 = a.enter();
        {
            let _g2 = a.enter();
            assert_eq!(a.in_flight(), 2);
        }
        assert_eq!(a.in_flight(), 1);
        drop(g1);
        assert_eq!(a.in_flight(), 0);
        let round = GateRound {
            session: "s",
            rows: 3,
            time: Duration::from_millis(5),
            depth: 2,
            accepted: 1,
            continued: true,
            one_off_setup: false,
            depth_limit: 0,
        };
        assert_eq!(a.observe_and_advise(round), None);
    }

    #[test]
    fn round_gaps_interpolate_and_extrapolate_from_what_was_measured() {
        let mut g = LoadGate::new(8);
        assert_eq!(
            g.round_gap(4, 1),
            0.0,
            "nothing measured: the pass time alone decides"
        );
        g.observe_gap(4, Duration::from_millis(8), 1);
        // One depth measured: the line through no gap at depth 0 below it, flat above it.
        assert!((g.round_gap(2, 1) - 0.004).abs() < 1e-9);
        assert!((g.round_gap(0, 1) - 0.0).abs() < 1e-9);
        assert!((g.round_gap(6, 1) - 0.008).abs() < 1e-9);
        g.observe_gap(0, Duration::from_millis(1), 1);
        assert!((g.round_gap(0, 1) - 0.001).abs() < 1e-9);
        assert!((g.round_gap(2, 1) - 0.0045).abs() < 1e-9);
        // Beyond the only drafted depth measured: flat (depth 0's gap has no draft call in it).
        assert!((g.round_gap(8, 1) - 0.008).abs() < 1e-9);
        // Two drafted depths measured: along their slope beyond them.
        g.observe_gap(2, Duration::from_millis(5), 1);
        assert!((g.round_gap(6, 1) - 0.011).abs() < 1e-9);
        assert!((g.round_gap(8, 1) - 0.014).abs() < 1e-9);
        // A pause of the client is not a round's gap.
        g.observe_gap(8, MAX_ROUND_GAP + Duration::from_millis(1), 1);
        assert!((g.round_gap(8, 1) - 0.014).abs() < 1e-9);
        // Deeper than the gate advises counts at its deepest depth.
        g.observe_gap(30, Duration::from_millis(20), 1);
        assert!((g.round_gap(8, 1) - 0.020).abs() < 1e-9);
    }

    #[test]
    fn a_latency_bound_target_gets_no_draft_when_drafting_costs_more_than_it_saves() {
        // Passes cost 20 ms whatever their rows: free drafts would go deepest.
        let mut g = gate(8, 1..=600, |_| 0.02);
        assert_eq!(g.advise(4), Some(8));
        // A session drafting to depth 4 comes back 100 ms after its answer, one not drafting
        // after 1 ms: at acceptance 0.8 a round of depth 4 gives 3.4 tokens in 120 ms, one of
        // depth 1 (a gap of 25.75 ms between the two) 1.8 in 45.75 ms, one without a draft
        // 1 token in 21 ms.
        for _ in 0..20 {
            g.observe_gap(4, Duration::from_millis(100), 4);
            g.observe_gap(0, Duration::from_millis(1), 4);
        }
        assert_eq!(g.advise(4), Some(0));
        // Drafting that takes 2 ms a level pays again.
        let mut g = gate(8, 1..=600, |_| 0.02);
        for _ in 0..20 {
            g.observe_gap(4, Duration::from_millis(9), 4);
            g.observe_gap(0, Duration::from_millis(1), 4);
        }
        assert!(g.advise(4).unwrap() >= 4, "{:?}", g.advise(4));
    }

    #[test]
    fn the_advisor_measures_each_sessions_gap_and_counts_recent_sessions_in_the_batch() {
        let a = LoadAdvisor::new(8);
        // Two sessions answered: the batch the advice is for holds both.
        assert_eq!(a.note_answer("a", Instant::now(), 3, false).0, 1);
        let t0 = Instant::now();
        assert_eq!(a.note_answer("b", t0, 3, false), (2, None));
        // Its first round after the prompt waits for the draft to catch up: not measured.
        a.observe_request("b", 3, t0 + Duration::from_millis(90));
        assert_eq!(a.gate.lock().unwrap().round_gap(3, 1), 0.0);
        let t = t0 + Duration::from_millis(100);
        assert_eq!(a.note_answer("b", t, 3, true), (2, None));
        // Session b's next round, drafted to depth 3, came 30 ms after its answer.
        a.observe_request("b", 3, t + Duration::from_millis(30));
        let gap = a.gate.lock().unwrap().round_gap(3, 1);
        assert!((gap - 0.030).abs() < 1e-9, "{gap}");
        // A session never answered here has no gap.
        a.observe_request("c", 3, t + Duration::from_millis(500));
        let gap = a.gate.lock().unwrap().round_gap(3, 1);
        assert!((gap - 0.030).abs() < 1e-9, "{gap}");
        // Sessions answered long ago no longer count.
        assert_eq!(a.note_answer("d", t + ACTIVE_WINDOW * 3, 3, false).0, 1);
        assert_eq!(
            a.note_answer("b", t + ACTIVE_WINDOW * 3, 3, true).1,
            Some(t)
        );
        // A new prompt starts over.
        a.note_answer("b", t + ACTIVE_WINDOW * 4, 3, false);
        assert_eq!(a.note_answer("b", t + ACTIVE_WINDOW * 5, 3, true).1, None);
        // A draft after a round without one first catches up with the tokens it missed:
        // neither its gap nor its cycle is measured; the next draft's are.
        let t = t + ACTIVE_WINDOW * 6;
        a.note_answer("b", t, 0, true);
        a.observe_request("b", 3, t + Duration::from_millis(80));
        let gap = a.gate.lock().unwrap().round_gap(3, 1);
        assert!((gap - 0.030).abs() < 1e-9, "{gap}");
        let t2 = t + Duration::from_millis(90);
        assert_eq!(a.note_answer("b", t2, 3, true).1, None);
        let t3 = t2 + Duration::from_millis(20);
        assert_eq!(a.note_answer("b", t3, 3, true).1, Some(t2));
    }

    #[test]
    fn the_advisor_remembers_its_advice_so_capped_rounds_do_not_cap_it() {
        let a = LoadAdvisor::with_gate(gate(8, 1..=600, |_| 0.02));
        let round = |depth| GateRound {
            session: "s",
            rows: depth + 1,
            time: Duration::from_millis(20),
            depth,
            accepted: depth,
            continued: true,
            one_off_setup: false,
            depth_limit: 0,
        };
        // Free drafts and 20 ms passes: the deepest depth.
        let advice = a.observe_and_advise(round(0));
        assert_eq!(advice, Some(8));
        assert_eq!(a.gate.lock().unwrap().last_advice, advice);
        // Rounds drafted as deep as advised do not cap the next advice.
        for _ in 0..4 {
            assert_eq!(a.observe_and_advise(round(8)), Some(8));
        }
        assert_eq!(a.gate.lock().unwrap().deepest, None);
    }

    #[test]
    fn a_draft_must_beat_none_by_the_margin_once_measured() {
        // One session, a one-token pass of 1 ms, a two-token pass of 1 + s ms, drafting free:
        // a draft of one token (1.8 tokens at α = 0.8) promises 1.8 / (1 + s) times as much.
        // `measured`: rounds of depth 1 measured at this load level, each as the model says.
        let advice = |s: f64, measured: usize| {
            let mut g = gate(1, [1, 2, 1, 2], |r| 1e-3 * (1.0 + s * (r - 1.0)));
            g.observe_depth_limit(1);
            for _ in 0..measured {
                g.observe_cycle(1, Duration::from_secs_f64(1e-3 * (1.0 + s)), 1);
            }
            g.advise(1)
        };
        assert_eq!(advice(0.2857, 0), Some(1), "1.4 times as much");
        assert_eq!(advice(0.2857, 2), Some(1), "1.4 times as much, measured");
        // Within the margin, a depth is tried until two of its rounds are measured, then
        // judged by them with the margin.
        assert_eq!(advice(0.565, 0), Some(1), "1.15 times as much: tried");
        assert_eq!(advice(0.565, 1), Some(1), "one round measured: tried again");
        assert_eq!(
            advice(0.565, 2),
            Some(0),
            "1.15 times as much, measured: within the margin"
        );
        assert_eq!(advice(0.9, 0), Some(0), "less than none: not tried");
        // Where the sessions' depth is not known, nothing is tried: it might be a depth that
        // none of them drafts, which would never be measured.
        let g = gate(1, [1, 2, 1, 2], |r| 1e-3 * (1.0 + 0.565 * (r - 1.0)));
        assert_eq!(g.advise(1), Some(0), "no depth known");
    }

    #[test]
    fn a_round_past_the_models_group_of_rows_is_priced_a_pass_a_group() {
        // Passes of up to 64 rows, 10 ms of weight reads and 0.04 ms a row; the model runs more
        // rows in groups of 64, a pass each. Extending the table's last slope prices 64
        // sessions' depth-1 round (128 rows) at 15.1 ms, where two passes take 25.1.
        let t = |r: f64| 1e-2 + 4e-5 * r;
        let advice = |group: Option<usize>, batch: usize| {
            let mut g = gate(4, (1..=64).chain(1..=64), t).with_group_rows(group);
            g.observe_depth_limit(4);
            g.advise(batch)
        };
        assert!(advice(None, 64).is_some_and(|d| d > 0), "one pass");
        assert_eq!(advice(Some(64), 64), Some(0), "two passes: not even tried");
        // Within the group, the same advice.
        assert_eq!(advice(Some(64), 4), advice(None, 4));
        assert_eq!(advice(Some(64), 4), Some(4));
        let g = gate(4, 1..=64, t).with_group_rows(Some(64));
        let pts = g.pass_points().expect("measured");
        let two = grouped_pass_at(&pts, 128.0, Some(64));
        assert!((two - 2.0 * t(64.0)).abs() < 1e-4, "{two}");
    }

    #[test]
    fn ended_sessions_do_not_count_in_the_batch() {
        let a = LoadAdvisor::new(4);
        let t = Instant::now();
        for s in ["a", "b", "c", "d"] {
            a.note_answer(s, t, 4, true);
        }
        // Four sessions end; four new ones start at once, as a client's next batch does.
        for s in ["a", "b", "c", "d"] {
            a.forget(s);
        }
        let mut active = 0;
        for s in ["e", "f", "g", "h"] {
            active = a.note_answer(s, t + Duration::from_millis(5), 0, false).0;
        }
        assert_eq!(active, 4, "not the eight answered within the window");
        // Forgotten, a session of the same id starts afresh: no cycle from its old answer.
        a.forget("e");
        let (active, last) = a.note_answer("e", t + Duration::from_millis(9), 4, true);
        assert_eq!((active, last), (4, None));
    }

    #[test]
    fn the_advice_is_for_the_batch_served_lately() {
        // Passes cost 5 ms up to 4 rows, then 2 ms a row more: one session drafts 4 deep,
        // four sessions draft none (no depth would win even without the margin).
        let t = |r: f64| 0.005 + (r - 4.0).max(0.0) * 0.002;
        let mut g = gate(4, 1..=64, t);
        assert_eq!((g.advise(1), g.advise(4)), (Some(4), Some(0)));
        let t0 = Instant::now();
        // Four sessions served together; then a burst's first prompt, answered alone.
        assert_eq!(g.note_batch(4, t0), 4);
        assert_eq!(g.note_batch(1, t0 + Duration::from_millis(20)), 4);
        // A larger batch raises the peak at once; past the memory, the batch of the moment.
        assert_eq!(g.note_batch(6, t0 + Duration::from_millis(30)), 6);
        let later = t0 + Duration::from_millis(30) + PEAK_MEMORY + Duration::from_millis(1);
        assert_eq!(g.note_batch(1, later), 1);
        // Through the advisor: a session alone just after four, its prompt's round and the
        // next, gets the advice for four.
        let a = LoadAdvisor::with_gate(gate(4, 1..=64, t));
        let round = |session, continued| GateRound {
            session,
            rows: 5,
            time: Duration::from_secs_f64(t(5.0)),
            depth: 0,
            accepted: 0,
            continued,
            one_off_setup: false,
            depth_limit: 0,
        };
        for s in ["a", "b", "c", "d"] {
            a.observe_and_advise(round(s, true));
        }
        for s in ["a", "b", "c", "d"] {
            a.forget(s);
        }
        assert_eq!(a.observe_and_advise(round("e", false)), Some(0));
        assert_eq!(a.observe_and_advise(round("e", true)), Some(0));
    }

    #[test]
    fn a_new_prompts_round_does_not_price_a_pass() {
        // Verify passes: 10 ms up to 16 rows, then 1 ms a row more.
        let t = |r: f64| 0.010 + (r - 16.0).max(0.0) * 0.001;
        let a = LoadAdvisor::with_gate(gate(4, [4, 8, 16, 32], t));
        let predicted = |a: &LoadAdvisor| a.gate.lock().unwrap().pass_secs(144.0).unwrap();
        let before = predicted(&a);
        assert!((before - t(144.0)).abs() < 1e-9);
        // Rounds of 128-token prompts beside 16 rows of others, their model time a prefill's
        // (6 ms, far below a verify pass of 144 rows).
        let round = |session, continued| GateRound {
            session,
            rows: 144,
            time: Duration::from_millis(6),
            depth: 0,
            accepted: 0,
            continued,
            one_off_setup: false,
            depth_limit: 0,
        };
        for s in ["a", "b", "c"] {
            a.observe_and_advise(round(s, false));
        }
        assert_eq!(predicted(&a), before);
        // The same rounds continuing a sequence are verify passes, and priced.
        for s in ["a", "b", "c"] {
            a.observe_and_advise(round(s, true));
        }
        assert!(predicted(&a) < 0.5 * before);
    }

    #[test]
    fn rounds_slowed_by_one_off_setup_do_not_price_their_depth() {
        // Four sessions, passes of 5 ms whatever their rows: the model advises the deepest.
        // Each session's prompt, a first round (not measured: the draft catches up), then two
        // rounds whose every session waited 40 ms more, as behind a draft pass of a new shape.
        let advise_after_stalls = |flagged: bool| {
            let a = LoadAdvisor::with_gate(gate(4, 1..=64, |_| 0.005));
            let round = |session, continued, one_off_setup| GateRound {
                session,
                rows: 20,
                time: Duration::from_millis(5),
                depth: 4,
                accepted: 4,
                continued,
                one_off_setup,
                depth_limit: 0,
            };
            let sessions = ["a", "b", "c", "d"];
            for s in sessions {
                a.observe_and_advise(round(s, false, false));
            }
            for s in sessions {
                a.observe_and_advise(round(s, true, false));
            }
            let mut advice = None;
            for _ in 0..2 {
                std::thread::sleep(Duration::from_millis(40));
                for s in sessions {
                    advice = a.observe_and_advise(round(s, true, flagged));
                }
            }
            advice
        };
        // Told of the setup, the gate keeps the depth; not told, the stall prices it out (at
        // 4 × 3.36 tokens in 40 ms, worse than the model's shallower depths).
        assert_eq!(advise_after_stalls(true), Some(4));
        assert!(advise_after_stalls(false).is_some_and(|d| d < 4));
    }

    #[test]
    fn cycles_that_span_another_sessions_prompt_are_not_measured() {
        // Passes whose time grows with their rows (6 ms at 4 rows): target-only rounds win,
        // even without the margin. Four sessions go through target-only rounds 40 ms apart,
        // as behind other sessions' prefills.
        let advise_after_slow_rounds = |prompts_between: bool| {
            let a = LoadAdvisor::with_gate(gate(4, 1..=64, |r| 0.0004 + 0.0014 * r));
            let round = |session, continued| GateRound {
                session,
                rows: 4,
                time: Duration::from_millis(6),
                depth: 0,
                accepted: 0,
                continued,
                one_off_setup: false,
                depth_limit: 4,
            };
            let sessions = ["a", "b", "c", "d"];
            for s in sessions {
                a.observe_and_advise(round(s, false));
            }
            for s in sessions {
                a.observe_and_advise(round(s, true));
            }
            let mut advice = None;
            for new in ["e", "f", "g"] {
                std::thread::sleep(Duration::from_millis(40));
                if prompts_between {
                    a.observe_and_advise(round(new, false));
                }
                for s in sessions {
                    advice = a.observe_and_advise(round(s, true));
                }
            }
            advice
        };
        // Rounds 40 ms apart with no prompt between price target-only rounds at 40 ms, and a
        // draft looks better; the same rounds spanning new sessions' prompts are not measured,
        // and the model's advice stands.
        assert!(advise_after_slow_rounds(false).is_some_and(|d| d > 0));
        assert_eq!(advise_after_slow_rounds(true), Some(0));
    }

    #[test]
    fn rounds_capped_by_the_advice_do_not_cap_later_advice() {
        let mut g = gate(8, 1..=600, |_| 0.02);
        // Sessions draft 4 deep by themselves: the advice goes no deeper.
        g.observe_cycle(4, Duration::from_millis(20), 1);
        assert_eq!(g.advise(1), Some(4));
        // Advised 2, they draft 2: that says nothing of how deep they would go.
        g.last_advice = Some(2);
        for _ in 0..5 {
            g.observe_cycle(2, Duration::from_millis(25), 1);
        }
        assert_eq!(g.deepest.map(|d| d.0), Some(4));
        // Capped rounds of target-only sessions beside them do not become the cap either.
        g.last_advice = Some(0);
        g.observe_cycle(0, Duration::from_millis(21), 1);
        assert_eq!(g.deepest.map(|d| d.0), Some(4));
        // Once what they drafted by themselves is forgotten, every depth is open again.
        g.deepest = Some((4, Instant::now() - DEEPEST_MEMORY * 2));
        g.observe_cycle(2, Duration::from_millis(25), 1);
        assert!(g.advise(1).unwrap() > 4, "{:?}", g.advise(1));
    }

    #[test]
    fn a_generations_last_rounds_do_not_cap_the_advice_where_the_depth_limit_is_told() {
        // Free drafts and 20 ms passes: the deepest depth the sessions draft. A round as the
        // advisor records it: the session's limit (0: not told), its cycle, then the advice.
        let round = |g: &mut LoadGate, depth, limit| {
            g.observe_depth_limit(limit);
            g.observe_cycle(depth, Duration::from_millis(20), 2);
            let advice = g.advise(2);
            g.last_advice = advice;
            advice
        };
        let mut told = gate(8, 1..=600, |_| 0.02);
        let mut untold = gate(8, 1..=600, |_| 0.02);
        assert_eq!(told.advise(2), Some(8));
        // Sessions that draft 6 deep by themselves.
        assert_eq!(round(&mut told, 6, 6), Some(6));
        assert_eq!(round(&mut untold, 6, 0), Some(6));
        // Rounds as deep as the advice say nothing new: what the sessions drafted by
        // themselves grows old.
        for g in [&mut told, &mut untold] {
            g.deepest = Some((6, Instant::now() - DEEPEST_MEMORY * 2));
        }
        // Then a generation ends: its last rounds draft no deeper than the tokens it may still
        // emit, 2 and 1. Told the session's own depth, the gate keeps advising it; inferring
        // it from the drafted depth, those rounds cap every session's advice, and the rounds
        // the cap holds down keep it.
        assert_eq!(round(&mut told, 2, 6), Some(6));
        assert_eq!(round(&mut told, 1, 6), Some(6));
        assert_eq!(round(&mut untold, 2, 0), Some(2));
        assert_eq!(round(&mut untold, 1, 0), Some(2));
        assert_eq!(round(&mut untold, 2, 0), Some(2));
        // A deeper limit told lifts the cap at once; a shallower one lasts while it is the
        // deepest told within the memory.
        assert_eq!(round(&mut told, 6, 8), Some(8));
        assert_eq!(round(&mut told, 3, 3), Some(8));
        told.deepest = Some((8, Instant::now() - DEEPEST_MEMORY * 2));
        assert_eq!(round(&mut told, 3, 3), Some(3));
    }

    #[test]
    fn measured_rounds_overrule_the_model_for_their_depth() {
        // The model alone: a latency-bound target and cheap drafts, the deepest draft.
        let mut g = gate(8, 1..=600, |_| 0.02);
        assert_eq!(g.advise(16), Some(8));
        // But rounds of depth 8 measured a 120 ms cycle (they missed passes), and rounds
        // without a draft a 21 ms cycle.
        for _ in 0..10 {
            g.observe_cycle(8, Duration::from_millis(120), 16);
            g.observe_cycle(0, Duration::from_millis(21), 16);
        }
        // At α = 0.8 depth 8 measured 4.3 tokens in 120 ms, 0.036 tokens/ms, target-only 0.048;
        // the model's unmeasured depths (1.8 tokens in 20 ms at depth 1) still look better: the
        // gate tries one.
        let d = g.advise(16).unwrap();
        assert!((1..8).contains(&d), "{d}");
        // Every depth measured as slower than target-only: no draft.
        for d in 1..=8 {
            for _ in 0..10 {
                g.observe_cycle(d, Duration::from_millis(60 + 10 * d as u64), 16);
            }
        }
        assert_eq!(g.advise(16), Some(0));
        // A pause is not a cycle.
        g.observe_cycle(0, MAX_ROUND_GAP * 2, 16);
        assert_eq!(g.advise(16), Some(0));
    }

    #[test]
    fn what_a_depth_measured_at_one_load_does_not_stand_for_another() {
        // A target whose passes cost 5 ms a row: by the model alone, no draft pays.
        let mut g = gate(8, 1..=600, |r| 5e-3 * r);
        assert_eq!(g.advise(4), Some(0));
        // One session alone measured rounds of depth 8 a 10 ms cycle (4.3 tokens at α = 0.8),
        // far better than its 20 ms rounds without a draft.
        for _ in 0..10 {
            g.observe_cycle(8, Duration::from_millis(10), 1);
            g.observe_cycle(0, Duration::from_millis(20), 1);
            g.observe_gap(8, Duration::from_millis(1), 1);
        }
        assert_eq!(g.advise(1), Some(8));
        // Four sessions: that was measured at another load; the model decides again there.
        assert_eq!(g.advise(4), Some(0));
        // The drafting time measured alone stands in for four sessions' four times over.
        assert!(
            (g.round_gap(8, 4) - 0.004).abs() < 1e-9,
            "{}",
            g.round_gap(8, 4)
        );
        // Measured at four sessions too (batches of 4 to 7 share a level), it counts there.
        for _ in 0..10 {
            g.observe_cycle(8, Duration::from_millis(10), 5);
            g.observe_cycle(0, Duration::from_millis(20), 5);
        }
        assert_eq!(g.advise(4), Some(8));
        assert_eq!(g.advise(8), Some(0));
    }

    #[test]
    fn a_depth_is_judged_by_the_acceptance_of_every_verdict_not_its_own_few_rounds() {
        // One session: passes of 5 ms, drafting 0.75 ms a level. At α = 0.8, depth 4's rounds
        // (8.5 ms) give 3.36 tokens, depth 3's (7.8 ms) 2.95: depth 4 is the faster.
        let mut g = gate(4, 1..=64, |_| 0.005);
        g.observe_cycle(3, Duration::from_micros(7_800), 1);
        g.observe_cycle(4, Duration::from_micros(8_500), 1);
        for d in 0..=2 {
            g.observe_cycle(d, Duration::from_micros(5_600 + 750 * d as u64), 1);
        }
        assert_eq!(g.advise(1), Some(4));
        // Depth 4's one round got only its bonus token accepted: that is the acceptance's
        // business (one verdict among many), not a verdict on depth 4.
        g.observe_verdict(4, 0);
        assert_eq!(g.advise(1), Some(4));
    }

    #[test]
    fn a_one_off_stall_does_not_keep_deeper_drafts_from_being_tried() {
        // One session, passes of 5 ms whatever their rows, drafting 0.75 ms a level.
        let mut g = gate(4, 1..=64, |_| 0.005);
        let ms = |x: f64| Duration::from_secs_f64(x / 1e3);
        // Sessions draft 4 deep by themselves; advised depth 1, they draft 1.
        g.deepest = Some((4, Instant::now()));
        g.last_advice = Some(1);
        // Depth 1's first measured round waited 60 ms (a CUDA graph captured), the next two
        // 0.75 ms: drafting is cheap, and deeper drafts pay.
        g.observe_gap(1, ms(60.0), 1);
        g.observe_cycle(1, ms(66.0), 1);
        for _ in 0..2 {
            g.observe_gap(1, ms(0.75), 1);
            g.observe_cycle(1, ms(6.5), 1);
        }
        assert!((g.round_gap(1, 1) - 0.00075).abs() < 1e-12);
        assert_eq!(g.advise(1), Some(4));
    }

    #[test]
    fn recent_samples_keep_the_latest_and_stand_by_their_lower_median() {
        let now = Instant::now();
        let mut slot = None;
        Recent::record(&mut slot, 60.0, now);
        assert_eq!(slot.unwrap().median(), 60.0);
        Recent::record(&mut slot, 1.0, now);
        assert_eq!(slot.unwrap().median(), 1.0);
        for x in 2..=9 {
            Recent::record(&mut slot, x as f64, now);
        }
        // The 60 and the 1 are gone: 2..=9 remain.
        let r = slot.unwrap();
        assert_eq!((r.len, r.median()), (RECENT, 5.0));
        // Stale samples start over.
        let later = now + GAP_MEMORY * 2;
        assert!(!r.fresh(later));
        Recent::record(&mut slot, 7.5, later);
        assert_eq!((slot.unwrap().len, slot.unwrap().median()), (1, 7.5));
    }

    #[test]
    fn a_few_samples_close_together_stand_only_briefly_and_later_samples_join_them() {
        let now = Instant::now();
        let mut slot = None;
        for x in [30.0, 31.0, 29.0] {
            Recent::record(&mut slot, x, now);
        }
        let r = slot.unwrap();
        assert!(!r.settled());
        assert!(r.stands(now + PROVISIONAL_MEMORY));
        assert!(!r.stands(now + PROVISIONAL_MEMORY * 2));
        // The next trial's first sample joins them, more than a second after the first, and
        // does not settle them (they would stand for 30 s by a median it cannot move).
        let later = now + SETTLE_SPAN + Duration::from_millis(100);
        Recent::record(&mut slot, 4.0, later);
        let r = slot.unwrap();
        assert_eq!((r.len, r.median()), (4, 29.0));
        assert!(!r.settled());
        // Its next samples, each within half a second of the one before, outvote the earlier
        // ones (the lower median now one of its own) and, a second after its first, settle
        // the measurement.
        let ms = |x: u64| Duration::from_millis(x);
        for (x, at) in [(4.5, later + ms(450)), (5.0, later + ms(900))] {
            Recent::record(&mut slot, x, at);
        }
        let r = slot.unwrap();
        assert_eq!((r.len, r.median()), (6, 5.0));
        assert!(!r.settled());
        Recent::record(&mut slot, 4.1, later + SETTLE_SPAN);
        let r = slot.unwrap();
        assert_eq!((r.len, r.median()), (7, 5.0));
        assert!(r.settled());
        assert!(r.stands(later + SETTLE_SPAN + GAP_MEMORY));
        // Eight samples settle it at once.
        let mut slot = None;
        for x in 0..RECENT {
            Recent::record(&mut slot, x as f64, now);
        }
        assert!(slot.unwrap().settled());
        assert!(slot.unwrap().stands(now + GAP_MEMORY));
    }

    /// Moves every gap and cycle `gate` measured `by` into the past.
    fn age(gate: &mut LoadGate, by: Duration) {
        for r in gate
            .gaps
            .iter_mut()
            .chain(gate.cycles.iter_mut())
            .flatten()
            .flatten()
        {
            r.at = r.at.checked_sub(by).expect("an instant that far back");
            r.since = r.since.checked_sub(by).expect("an instant that far back");
        }
    }

    #[test]
    fn drafting_priced_off_by_a_few_rounds_at_a_new_load_is_tried_again() {
        // Four sessions; passes of 5 ms up to 64 rows, then 0.08 ms a row.
        let mut g = gate(4, 1..=600, |r| 0.005f64.max(8e-5 * r));
        let ms = |x: f64| Duration::from_secs_f64(x / 1e3);
        g.observe_depth_limit(4);
        for _ in 0..RECENT {
            g.observe_gap(0, ms(0.3), 4);
        }
        // The first rounds drafted at this load waited 30 ms for the draft worker (every
        // session's draft catching up with its prompt): no draft pays.
        for _ in 0..3 {
            g.observe_gap(4, ms(30.0), 4);
        }
        assert_eq!(g.advise(4), Some(0));
        // Half a second later those few samples have lapsed: the depth is tried again.
        age(&mut g, PROVISIONAL_MEMORY + ms(1.0));
        g.observe_depth_limit(4);
        assert_eq!(g.advise(4), Some(4));
        // Its rounds now cost 4 ms of drafting: they join the earlier ones and outvote them.
        for _ in 0..4 {
            g.observe_gap(4, ms(4.0), 4);
        }
        assert!(
            (g.round_gap(4, 4) - 0.004).abs() < 1e-9,
            "{}",
            g.round_gap(4, 4)
        );
        assert_eq!(g.advise(4), Some(4));
        // Where drafting costs that much in a full window of rounds, it is not tried again.
        let mut g = gate(4, 1..=600, |r| 0.005f64.max(8e-5 * r));
        g.observe_depth_limit(4);
        for _ in 0..RECENT {
            g.observe_gap(0, ms(0.3), 4);
            g.observe_gap(4, ms(30.0), 4);
        }
        assert_eq!(g.advise(4), Some(0));
        age(&mut g, PROVISIONAL_MEMORY + ms(1.0));
        g.observe_depth_limit(4);
        assert_eq!(g.advise(4), Some(0));
    }

    #[test]
    fn an_unmeasured_load_level_borrows_the_nearest_levels_drafting_time_scaled() {
        // Passes cost 20 ms whatever their rows: free drafts would go deepest at any batch.
        let mut g = gate(8, 1..=600, |_| 0.02);
        assert_eq!(g.advise(64), Some(8));
        // One session alone: 1 ms between rounds without a draft, 8 ms drafting 8 deep.
        g.observe_gap(0, Duration::from_millis(1), 1);
        g.observe_gap(8, Duration::from_millis(9), 1);
        assert_eq!(g.advise(1), Some(8));
        // At 64 sessions those 8 ms of drafting stand for 64 times as much: no draft pays.
        assert!((g.round_gap(8, 64) - (0.001 + 0.008 * 64.0)).abs() < 1e-9);
        assert_eq!(g.advise(64), Some(0));
        // Its own depth-0 gap measured, a level still borrows the drafting time.
        g.observe_gap(0, Duration::from_millis(2), 64);
        assert!((g.round_gap(8, 64) - (0.002 + 0.008 * 64.0)).abs() < 1e-9);
        assert_eq!(g.advise(64), Some(0));
        // Measured drafting at 64 sessions (the draft worker shares its passes) is its own.
        g.observe_gap(8, Duration::from_millis(4), 64);
        assert!((g.round_gap(8, 64) - 0.004).abs() < 1e-9);
        assert_eq!(g.advise(64), Some(8));
        // A larger level measured only borrows downwards too, scaled down.
        let mut g = gate(8, 1..=600, |_| 0.02);
        g.observe_gap(0, Duration::from_millis(1), 16);
        g.observe_gap(4, Duration::from_millis(65), 16);
        assert!((g.round_gap(4, 4) - (0.001 + 0.064 / 4.0)).abs() < 1e-9);
    }

    #[test]
    fn one_drafted_depth_measured_does_not_keep_deeper_drafts_from_being_tried() {
        // One session: passes of 5.3 ms; target-only rounds come back after 0.1 ms, rounds
        // drafting one token after 2.1 ms (a draft call's fixed cost and one level). A slope
        // through depth 0 would charge depth 4 8.1 ms of drafting and keep the gate at depth 1.
        let mut g = gate(4, 1..=64, |_| 0.0053);
        let ms = |x: f64| Duration::from_secs_f64(x / 1e3);
        // Advised depth 1, the drafting sessions draft 1 (capped), the others none.
        g.last_advice = Some(1);
        for _ in 0..4 {
            g.observe_gap(0, ms(0.1), 1);
            g.observe_gap(1, ms(2.1), 1);
            g.observe_cycle(0, ms(5.5), 1);
            g.observe_cycle(1, ms(7.4), 1);
        }
        assert_eq!(g.advise(1), Some(4));
    }

    #[test]
    fn a_stalled_pass_does_not_seed_its_size() {
        // One-row passes measured at 5.2 ms; the first 5-row pass stalled 400 ms (its kernels
        // compiled at their first use).
        let mut g = LoadGate::new(4);
        for _ in 0..4 {
            g.observe_pass(1, Duration::from_micros(5_200));
            g.observe_pass(2, Duration::from_micros(5_250));
        }
        g.observe_pass(5, Duration::from_millis(400));
        for i in 0..100 {
            g.observe_verdict(1, usize::from(i % 5 != 0));
        }
        let t5 = g.pass_secs(5.0).unwrap();
        assert!(t5 < 0.006, "{t5}");
        assert_eq!(g.advise(1), Some(4));
        // A real 5-row pass is recorded.
        g.observe_pass(5, Duration::from_micros(5_400));
        assert!((g.pass_secs(5.0).unwrap() - 0.0054).abs() < 1e-9);
        // Large passes that are just slow (a long prompt's prefill) are within the bound; one
        // alone, slower than the sizes measured more often predict, stands once seen twice.
        g.observe_pass(512, Duration::from_millis(60));
        assert!(g.pass_secs(512.0).unwrap() < 0.060);
        g.observe_pass(512, Duration::from_millis(60));
        assert!((g.pass_secs(512.0).unwrap() - 0.060).abs() < 1e-9);
    }

    #[test]
    fn a_depths_first_round_alone_does_not_keep_it_from_being_tried() {
        // One session: passes of 1 and 2 rows measured often (5.2, 5.25 ms), a prompt's 133
        // rows twice (12 ms); drafting 0.3 ms a level. The first 5-row pass took 20 ms (its
        // graph captured; within twice its rows as 2-row passes) and so did its round.
        let mut g = LoadGate::new(4);
        let ms = |x: f64| Duration::from_secs_f64(x / 1e3);
        for _ in 0..4 {
            g.observe_pass(1, ms(5.2));
            g.observe_pass(2, ms(5.25));
            g.observe_gap(1, ms(0.4), 1);
            g.observe_cycle(1, ms(5.7), 1);
        }
        g.observe_pass(133, ms(12.0));
        g.observe_pass(133, ms(12.0));
        g.observe_pass(5, ms(20.0));
        g.observe_cycle(4, ms(21.5), 1);
        for i in 0..100 {
            g.observe_verdict(1, usize::from(i % 5 != 0));
        }
        // Priced by that round, depth 4 would lose to depth 1 (3.36 / 21.5 against 1.8 / 5.7
        // tokens a ms); the model prices it at about 5.4 + 1.3 ms.
        assert!(g.pass_secs(5.0).unwrap() < 0.006);
        assert_eq!(g.advise(1), Some(4));
        // Measured again at its cost, the size and the depth stand by that.
        g.observe_pass(5, ms(5.4));
        g.observe_cycle(4, ms(6.0), 1);
        assert!((g.pass_secs(5.0).unwrap() - 0.0054).abs() < 1e-9);
        assert_eq!(g.advise(1), Some(4));
        // Rounds that really cost that much keep the depth out (the model's depth 3 next).
        for _ in 0..4 {
            g.observe_cycle(4, ms(21.5), 1);
        }
        assert_eq!(g.advise(1), Some(3));
    }
}
