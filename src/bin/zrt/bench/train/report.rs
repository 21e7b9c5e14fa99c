//! What `zrt bench train` prints from its measurements: the header, a
//! row per zrt configuration and per peer (a table, or JSON objects with
//! `--json`), the ratios against the peers, and `--plot`'s charts.

use anyhow::Result;
use serde_json::{json, Value};

use super::{bucket_label, gpt, step_flops, Measured, Measurements, TrainArgs};
use crate::bench::median;
use crate::estimate::model_state_bytes;

/// Bytes as MiB.
fn mib(b: f64) -> f64 {
    b / (1u64 << 20) as f64
}

/// The measurements of one `zrt bench train` run, and the options that
/// shape its report.
pub(super) struct Report<'a> {
    a: &'a TrainArgs,
    configs: &'a [Measured],
    peers: &'a [(String, &'a str)],
    m: &'a Measurements,
    /// The median of the rounds' matmul peaks, FLOP/s per core.
    peak: f64,
    /// Bucket sizes are named in the rows only when they are not
    /// DeepSpeed's default alone.
    name_buckets: bool,
    /// Backends are named in the rows only when there are several.
    several_backends: bool,
    /// The run uses Muon.
    muon: bool,
}

impl<'a> Report<'a> {
    pub(super) fn new(
        a: &'a TrainArgs,
        configs: &'a [Measured],
        peers: &'a [(String, &'a str)],
        m: &'a Measurements,
    ) -> Self {
        Report {
            a,
            configs,
            peers,
            m,
            peak: median(&m.peaks),
            name_buckets: a.reduce_bucket_sizes != [5e8],
            several_backends: a.backends.len() > 1,
            muon: a.optimizer == "muon",
        }
    }

    /// A peer's rows on model `size` (empty if it failed every round or
    /// did not run).
    pub(super) fn peer_rows(&self, size: &str, mode: &str) -> &'a [Value] {
        self.peers
            .iter()
            .zip(&self.m.peer_samples)
            .find(|((s, m), _)| s == size && *m == mode)
            .map_or(&[], |(_, r)| r.as_slice())
    }

    /// ` {backend}` when the rows must name it.
    fn tag(&self, backend: &str) -> String {
        match self.several_backends {
            true => format!(" {backend}"),
            false => String::new(),
        }
    }

    /// The table's header: what was measured, how, then the column names.
    pub(super) fn header(&self) {
        let a = self.a;
        println!(
            "fp32 {}, micro-batch {} per rank, 1 thread per rank, {} backend{}; medians of {} rounds x {} steps; matmul peak {:.1} GFLOP/s per core{}{}{}{}",
            match self.muon {
                true => "Muon (the blocks' matrices) and AdamW (the rest; MFU leaves out the Newton-Schulz FLOPs)",
                false => "AdamW",
            },
            a.micro,
            a.backends.join(" and "),
            if self.several_backends { "s" } else { "" },
            a.rounds,
            a.steps,
            self.peak / 1e9,
            match a.freeze_mlp {
                true => "; every block's MLP weights frozen (params, formula and ZeRO volume count the trained ones)",
                false => "",
            },
            match a.checkpoint_activations {
                true => "; every block's activations recomputed in backward (MFU counts model FLOPs, not the recompute)",
                false => "",
            },
            match a.layerdrop > 0.0 {
                true => format!(
                    "; LayerDrop {}: each block left out with that chance, {} (zrt: ShardPlan::unused_on_some_ranks; DDP: find_unused_parameters; MFU counts every block)",
                    a.layerdrop,
                    match a.layerdrop_same {
                        true => "the same blocks on every rank",
                        false => "drawn on each rank apart",
                    }
                ),
                false => String::new(),
            },
            match a.mlp_drop > 0.0 {
                true => format!(
                    "; MLP drop {}: each block's MLP left out with that chance, the block running, drawn on each rank apart (zrt: ShardPlan::partly_unused_on_some_ranks; DDP: find_unused_parameters; MFU counts every MLP)",
                    a.mlp_drop
                ),
                false => String::new(),
            }
        );
        println!(
            "{:<6} {:>5} {:<16} {:>8} {:>9} {:>8} {:>6} {:>9} {:>10} {:>10} {:>10} {:>10} {:>8} {:>8}",
            "model",
            "world",
            "impl",
            "params",
            "s/step",
            "tok/s",
            "MFU",
            "RSS MiB",
            "state MiB",
            "formula",
            "comm Mel",
            "ZeRO Mel",
            "comm s",
            "wait s"
        );
    }

    /// Prints configuration `k`'s row and returns its figures for `--plot`.
    pub(super) fn zrt_row(&self, k: usize) -> Result<Plotted> {
        let a = self.a;
        let (size, world, stage, bucket, backend) = &self.configs[k];
        let rows = &self.m.samples[k];
        let c = gpt(size)?;
        let name = match self.name_buckets {
            true => format!("zrt zero{stage} b{}", bucket_label(*bucket)),
            false => format!("zrt zero{stage}"),
        } + &self.tag(backend);
        let get = |f: &str| -> Vec<f64> { rows.iter().filter_map(|r| r[f].as_f64()).collect() };
        let t = median_time(rows);
        let params = rows
            .first()
            .and_then(|r| r["params"].as_f64())
            .unwrap_or(f64::NAN);
        let frozen = rows
            .first()
            .and_then(|r| r["frozen"].as_f64())
            .unwrap_or(0.0);
        let n = *world as f64;
        let tokens = (a.micro * c.seq) as f64 * n;
        let flops = step_flops(&c, params, frozen, tokens) / t;
        let mfu = flops / (self.peak * n);
        let rss = max_rss(rows);
        let state = median(&get("model_state_bytes"));
        // Muon's matrices keep one moment, the rest AdamW's two.
        let muon = (rows.first())
            .and_then(|r| r["muon_params"].as_f64())
            .unwrap_or(0.0);
        let formula = model_state_bytes(*stage, params, n, 4.0, 2.0 - muon / params);
        let comm = median(&get("comm_elements_per_step"));
        // Elements that must cross ranks per step by ZeRO's accounting: 2 Psi
        // (stages 0-2) or 3 Psi (stage 3), times (n-1)/n; none alone.
        let per_psi = if *stage == 3 { 3.0 } else { 2.0 };
        let zero = if *world == 1 {
            0.0
        } else {
            per_psi * params * (n - 1.0) / n
        };
        // Time the collectives took on their worker, and the part of it the
        // step was blocked on (the rest overlapped compute).
        let comm_time = median(&get("comm_seconds_per_step"));
        let wait = median(&get("comm_wait_seconds_per_step"));
        // The FSDP2 peer of a stage: reshard after forward for ZeRO-3, not otherwise.
        let fsdp = if *stage == 3 {
            "fsdp2_zero3"
        } else {
            "fsdp2_zero2"
        };
        let vs = |mode: &str| {
            if a.peer && *world == 2 {
                median_time(self.peer_rows(size, mode)) / t
            } else {
                f64::NAN
            }
        };
        let rss_vs = if a.peer && *world == 2 {
            max_rss(self.peer_rows(size, fsdp)) / rss
        } else {
            f64::NAN
        };
        let opt = |x: f64| if x.is_finite() { json!(x) } else { Value::Null };
        let line = match self.name_buckets {
            true => format!("{size} bucket {}", bucket_label(*bucket)),
            false => size.clone(),
        } + &self.tag(backend);
        if a.json {
            println!(
                "{}",
                json!({
                    "bench": "train", "model": size, "world": world, "impl": format!("zrt_zero{stage}"), "stage": stage,
                    // The backend the ranks said they ran on.
                    "backend": rows.first().map_or(Value::Null, |r| r["backend"].clone()),
                    "reduce_bucket_size": bucket,
                    "params": params, "seconds_per_step": t, "tokens_per_s": tokens / t, "flops_per_s": flops, "mfu": mfu,
                    "matmul_peak_flops_per_s": self.peak, "peak_rss_bytes": rss, "model_state_bytes": state,
                    "formula_bytes": formula, "comm_elements_per_step": comm, "zero_volume_elements": zero,
                    "comm_seconds_per_step": comm_time, "comm_wait_seconds_per_step": wait,
                    "ratio_step_time_vs_fsdp2": opt(vs(fsdp)),
                    "ratio_step_time_vs_ddp": opt(vs("ddp")), "ratio_rss_vs_fsdp2": opt(rss_vs),
                    "freeze_mlp": a.freeze_mlp, "checkpoint_activations": a.checkpoint_activations,
                    "layerdrop": a.layerdrop, "layerdrop_same": a.layerdrop_same, "mlp_drop": a.mlp_drop,
                })
            );
        } else {
            println!(
                "{:<6} {:>5} {:<16} {:>7.1}M {:>9.3} {:>8.0} {:>5.1}% {:>9.0} {:>10.1} {:>10.1} {:>10.1} {:>10.1} {:>8.3} {:>8.3}",
                size,
                world,
                name,
                params / 1e6,
                t,
                tokens / t,
                mfu * 100.0,
                mib(rss),
                mib(state),
                mib(formula),
                comm / 1e6,
                zero / 1e6,
                comm_time,
                wait
            );
        }
        Ok((line, *world, *stage, t, rss, state, formula))
    }

    /// Prints peer `mode`'s row on model `size` (2 ranks).
    pub(super) fn peer_row(&self, size: &str, mode: &str) -> Result<()> {
        let a = self.a;
        let c = gpt(size)?;
        let rows = self.peer_rows(size, mode);
        let (t, rss) = (median_time(rows), max_rss(rows));
        let tokens = (a.micro * c.seq * 2) as f64;
        if rows.is_empty() {
            // Its errors went to stderr as each round failed.
            match a.json {
                true => println!(
                    "{}",
                    json!({"bench": "train", "model": size, "world": 2, "impl": mode, "failed": true})
                ),
                false => println!(
                    "{:<6} {:>5} {:<16} failed in every round (its errors are above)",
                    size, 2, mode
                ),
            }
        } else if a.json {
            println!(
                "{}",
                json!({"bench": "train", "model": size, "world": 2, "impl": mode, "seconds_per_step": t, "tokens_per_s": tokens / t, "peak_rss_bytes": rss,
                    "freeze_mlp": a.freeze_mlp, "checkpoint_activations": a.checkpoint_activations,
                    "layerdrop": a.layerdrop, "layerdrop_same": a.layerdrop_same, "mlp_drop": a.mlp_drop})
            );
        } else {
            println!(
                "{:<6} {:>5} {:<16} {:>8} {:>9.3} {:>8.0} {:>6} {:>9.0}",
                size,
                2,
                mode,
                "",
                t,
                tokens / t,
                "",
                mib(rss)
            );
        }
        Ok(())
    }

    /// Under LayerDrop, MLP drop or Muon, where FSDP2 has no rows to
    /// compare with: DDP / zrt per stage.
    pub(super) fn ddp_ratios(&self) {
        let a = self.a;
        let uneven = a.layerdrop > 0.0 || a.mlp_drop > 0.0;
        for ((size, world, stage, bucket, backend), rows) in
            self.configs.iter().zip(&self.m.samples)
        {
            let ddp = self.peer_rows(size, "ddp");
            if *world != 2 || *bucket != a.reduce_bucket_sizes[0] || ddp.is_empty() {
                continue;
            }
            let mut what = Vec::new();
            if a.layerdrop > 0.0 {
                let same = if a.layerdrop_same {
                    " (same blocks)"
                } else {
                    ""
                };
                what.push(format!("LayerDrop {}{same}", a.layerdrop));
            }
            if a.mlp_drop > 0.0 {
                what.push(format!("MLP drop {}", a.mlp_drop));
            }
            if self.muon {
                what.push("Muon".to_string());
            }
            let peer = match (uneven, self.muon) {
                (true, true) => "DDP (find_unused_parameters, torch.optim.Muon)",
                (true, false) => "DDP (find_unused_parameters)",
                _ => "DDP (torch.optim.Muon and AdamW)",
            };
            println!(
                "{size} ZeRO-{stage}, 2 ranks{}, {}: {peer} / zrt step time {:.2}x, peak RSS {:.2}x (higher is better for zrt)",
                self.tag(backend),
                what.join(", "),
                median_time(ddp) / median_time(rows),
                max_rss(ddp) / max_rss(rows)
            );
        }
    }

    /// FSDP2 / zrt and DDP / zrt at ZeRO-3 and ZeRO-2 on 2 ranks, per
    /// model size and backend (the first bucket size's rows).
    pub(super) fn fsdp_ratios(&self) {
        let a = self.a;
        for size in &a.sizes {
            for ((stage, fsdp), backend) in [(3u8, "fsdp2_zero3"), (2, "fsdp2_zero2")]
                .into_iter()
                .flat_map(|s| a.backends.iter().map(move |b| (s, b)))
            {
                let Some(rows) = self
                    .configs
                    .iter()
                    .zip(&self.m.samples)
                    .find(|((s, w, st, b, be), _)| {
                        s == size
                            && *w == 2
                            && *st == stage
                            && *b == a.reduce_bucket_sizes[0]
                            && be == backend
                    })
                    .map(|(_, r)| r)
                else {
                    continue;
                };
                if self.peer_rows(size, fsdp).is_empty() {
                    // It failed in every round: its row says so.
                    continue;
                }
                let t = median_time(rows);
                println!(
                    "{size} ZeRO-{stage}, 2 ranks{}: FSDP2 / zrt step time {:.2}x, DDP / zrt {:.2}x, FSDP2 / zrt peak RSS {:.2}x (higher is better for zrt)",
                    match self.several_backends {
                        true => format!(", zrt on {backend}"),
                        false => String::new(),
                    },
                    median_time(self.peer_rows(size, fsdp)) / t,
                    median_time(self.peer_rows(size, "ddp")) / t,
                    max_rss(self.peer_rows(size, fsdp)) / max_rss(rows)
                );
            }
        }
    }
}

/// Median step time of a set of rank-0 rows.
fn median_time(rows: &[Value]) -> f64 {
    median(
        &rows
            .iter()
            .flat_map(|r| r["times"].as_array().cloned().unwrap_or_default())
            .filter_map(|v| v.as_f64())
            .collect::<Vec<_>>(),
    )
}

/// Largest peak RSS over the ranks of a set of rows.
fn max_rss(rows: &[Value]) -> f64 {
    rows.iter()
        .flat_map(|r| r["rss"].as_array().cloned().unwrap_or_default())
        .filter_map(|v| v.as_f64())
        .fold(f64::NAN, f64::max)
}

/// One zrt configuration's figures, as `--plot` draws them.
pub(super) type Plotted = (String, usize, u8, f64, f64, f64, f64);

/// The stage a peer's row sits at on the plots' x axis.
fn peer_stage(mode: &str) -> Option<f64> {
    Some(match mode {
        "ddp" => 0.0,
        "deepspeed_zero1" => 1.0,
        "fsdp2_zero2" | "deepspeed_zero2" => 2.0,
        "fsdp2_zero3" | "deepspeed_zero3" => 3.0,
        _ => return None,
    })
}

/// Writes `step_time.png` and `memory.png` into `dir`.
pub(super) fn plots<'a>(
    dir: &std::path::Path,
    rows: &[Plotted],
    peers: &[(String, &str)],
    peer_rows: &dyn Fn(&str, &str) -> &'a [Value],
) -> Result<()> {
    use crate::bench::plot::{by_stage, Series};
    std::fs::create_dir_all(dir)?;
    let mut keys: Vec<(String, usize)> = rows.iter().map(|r| (r.0.clone(), r.1)).collect();
    keys.dedup();
    let line = |label: String, f: &dyn Fn(&Plotted) -> f64, key: &(String, usize)| Series {
        label,
        points: rows
            .iter()
            .filter(|r| r.0 == key.0 && r.1 == key.1)
            .map(|r| (r.2 as f64, f(r)))
            .collect(),
        points_only: false,
    };
    let mut time: Vec<Series> = keys
        .iter()
        .map(|k| line(format!("zrt {} world {}", k.0, k.1), &|r| r.3, k))
        .collect();
    let mut memory: Vec<Series> = Vec::new();
    for k in &keys {
        memory.push(line(
            format!("zrt {} world {}: peak RSS", k.0, k.1),
            &|r| mib(r.4),
            k,
        ));
        memory.push(line(
            format!("zrt {} world {}: model state", k.0, k.1),
            &|r| mib(r.5),
            k,
        ));
        memory.push(Series {
            points_only: true,
            ..line(
                format!("{} world {}: DESIGN.md formula", k.0, k.1),
                &|r| mib(r.6),
                k,
            )
        });
    }
    // Peers (2 ranks) as markers at the stage they correspond to.
    let mut sizes: Vec<&String> = peers.iter().map(|p| &p.0).collect();
    sizes.dedup();
    for size in sizes {
        for (family, label) in [
            ("ddp", "DDP"),
            ("fsdp2", "FSDP2"),
            ("deepspeed", "DeepSpeed"),
        ] {
            let pts: Vec<(f64, f64, f64)> = peers
                .iter()
                .filter(|(s, m)| s == size && m.starts_with(family))
                .filter_map(|(s, m)| {
                    let r = peer_rows(s, m);
                    peer_stage(m).map(|x| (x, median_time(r), mib(max_rss(r))))
                })
                .collect();
            if pts.is_empty() {
                continue;
            }
            let name = format!("{label} {size} world 2");
            time.push(Series {
                label: name.clone(),
                points: pts.iter().map(|p| (p.0, p.1)).collect(),
                points_only: true,
            });
            memory.push(Series {
                label: format!("{name}: peak RSS"),
                points: pts.iter().map(|p| (p.0, p.2)).collect(),
                points_only: true,
            });
        }
    }
    by_stage(
        &dir.join("step_time.png"),
        "Training step time per ZeRO stage",
        "seconds per step",
        &time,
    )?;
    by_stage(
        &dir.join("memory.png"),
        "Memory per rank per ZeRO stage",
        "MiB",
        &memory,
    )
}
