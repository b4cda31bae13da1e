from eagle3prep.errors import one_line_errors
from eagle3prep.run.tickets import make_ticket

with one_line_errors():
    make_ticket(snakemake.output[0], snakemake.log[0])
