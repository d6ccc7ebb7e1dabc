"""The report of a comparison: the terminal screen, details.txt, report.html and its pictures, the notes and the
verdict, the cost model's prediction, the scaling sweep; write() is its one door."""
