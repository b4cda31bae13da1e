# eagle3prep: raw chats -> tokenized shards -> per-layer hidden-state shards -> validation -> report.
# Data contracts: DESIGN.md (layer numbering, shard format, manifest). Logic: src/eagle3prep/.
from snakemake.utils import min_version

min_version("9.0")


configfile: "config/config.yaml"


report: "report/workflow.rst"


include: "rules/common.smk"
include: "rules/demo.smk"
include: "rules/prepare.smk"
include: "rules/regenerate.smk"
include: "rules/tokenize.smk"
include: "rules/extract.smk"
include: "rules/validate.smk"
include: "rules/report.smk"
include: "rules/overfit_gate.smk"
include: "rules/export.smk"
include: "rules/plan.smk"


rule all:
    input:
        get_final_output(),
