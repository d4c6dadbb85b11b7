"""`python -m gazctl.spark compact|replay ...`: the Spark jobs as a module entry point, which is
also what `spark-submit` runs on a cluster:

    spark-submit --master spark://host:7077 "$(python -c 'import gazctl.spark.__main__ as m; print(m.__file__)')" \\
        compact -l prefix=events/ --broker.address http://broker:8080

(gazette-py must be installed where the executors run; the master comes from spark-submit.)"""

from __future__ import annotations

from gazctl.spark.cli import spark

if __name__ == "__main__":
    spark(prog_name="gazctl spark")
