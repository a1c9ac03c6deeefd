//! `specsplit-target`: the SpecSplit target worker: verifies draft token trees with the large model over gRPC.

use clap::Parser;
use specsplit_workers::cli::{worker_main, WorkerArgs, WorkerKind};

/// The SpecSplit target worker: verifies draft token trees with the large model over gRPC.
///
/// Settings come from defaults < the TOML file given by --config (section [target]) <
/// SPECSPLIT_TARGET__<KEY> environment variables < these flags. See docs/configuration.md.
#[derive(Parser)]
#[command(version, about, long_about)]
struct Cli {
    #[command(flatten)]
    args: WorkerArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    worker_main(WorkerKind::Target, cli.args)
        .await
        .map_err(anyhow::Error::from_boxed)
}
