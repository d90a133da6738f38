#!/usr/bin/env node
'use strict';
// An example handler process for kmqd (docs/HANDLERS.md), with the Node SDK next to it:
//
//   [plugins.mailer]
//   file = "libkmq_exec.so"
//   config = { command = "/usr/bin/node", args = ["/srv/mailer/example-handler.js"], types = ["report.build", "report.mail"], mode = "persistent", concurrency = 8 }

const { handle, run, Retry, Fail } = require('./kmq-handler');

handle('report.build', (task) => {
  const { rows } = task.data;
  if (rows === undefined) throw new TypeError('data has no rows'); // a failed attempt (retried)
  if (rows < 0) throw new Fail(`rows must be 0 or more, not ${rows}`);
  console.log(`building ${rows} rows`); // to standard error: kmqd's log, with the task's id
  return `built ${rows} rows`;
});

handle('report.mail', async (task) => {
  const { to } = task.data;
  if (!to.includes('@')) throw new Fail(`${JSON.stringify(to)} is not an address`);
  await new Promise((resolve) => setTimeout(resolve, 10)); // the SMTP conversation
  if (to.startsWith('busy@')) throw new Retry('mailbox busy', { afterMs: 50 });
  return `sent to ${to}`;
});

run();
