import django.db.models.functions.datetime
from django.db import migrations, models

from dispatch.core.sqlfiles import install


class Migration(migrations.Migration):
    """When a binding's alert settings last gained a recipient: a column (existing rows
    get the migration's time, so failures before it reach no address stored earlier, only
    the site's ADMINS) and the trigger that moves it, whatever writes the row
    (`dispatch_alert_recipients_changed`, in snapshot 0022)."""

    dependencies = [
        ('dispatch', '0021_printable_names'),
    ]

    operations = [
        migrations.AddField(
            model_name='bindinghealth',
            name='alert_settings_changed_at',
            field=models.DateTimeField(db_default=django.db.models.functions.datetime.Now(), editable=False),
        ),
        install("0022_functions.sql"),
    ]
