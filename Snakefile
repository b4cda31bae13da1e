# eagle3prep: raw chats -> tokenized shards -> per-layer hidden-state shards -> validation -> report.
# Data contracts: DESIGN.md (layer numbering, shard format, manifest). Logic: src/eagle3prep/.
import os
import sys

from snakemake.utils import min_version

from eagle3prep.config import ConfigError
from eagle3prep.run.parse import cli_configfiles, demo_config_error

min_version("9.0")

# A --configfile is the user's whole config over the schema's defaults; the demo's config/config.yaml is read
# only when none is given (a `configfile:` line alone would lay every --configfile over the demo's values).
try:
    CONFIGFILES = cli_configfiles(workflow)
except ConfigError as e:
    sys.exit(str(e))
if not CONFIGFILES:
    if _demo_error := demo_config_error(os.getcwd()):
        sys.exit(_demo_error)

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
